"""The valid operations enabled in a state, for the model checker (``kvspec.mc``).

One function per level, both reading only the reference model's state:

    enabled_pool_ops(model, config, bounds)            -> list[Op]
    enabled_cache_ops(model, config, bounds, ...)      -> list[Op]
    enabled_ops(model, config, bounds, ...)            -> list[Op]   (dispatches on config.level)

The domains follow the Hypothesis machines' rules (``kvspec.stateful.pool`` and
``kvspec.stateful.cache``), cut down to small finite sets so that a breadth-first
search can exhaust them. Every bound is a field of ``Bounds`` with the default
documented there; ``kvspec mc`` uses the defaults.

Pool level (``stateful/pool.py`` rules alloc, free, touch, cache, lookup, reset):

    Alloc(n)           n = 1 .. free blocks (at most ``max_alloc``)
    Free(blocks)       ordered sequences of distinct held blocks, length 1 .. ``max_set``
    Touch(blocks)      ordered sequences of distinct held or cached blocks, length 1 .. ``max_set``
    Cache(blocks, hs)  ordered sequences of distinct held, unhashed blocks, length 1 .. ``max_set``,
                       each with a label from ``labels`` (labels may repeat: equal content)
    Lookup(label)      each label
    Reset()

State constraints, as TLC's CONSTRAINT: no op is enabled that would push a block's
ref count above ``max_ref`` or the sum of all ref counts above ``max_holders``.

Cache level (``stateful/cache.py`` rules admit_new, admit_waiting, step, preempt, finish):

    Admit(new id, prompt)  prompt from ``prompts`` (default ``default_prompts``), while fewer
                           than ``requests`` requests exist
    Admit(id)              each waiting request (refused earlier, or preempted)
    Step(id, token)        each running request whose last Step was not refused (the engine
                           preempts instead: ``CacheModel.steppable``), token from ``step_tokens``
                           (default ``default_step_tokens``), while it has fewer than
                           ``max_tokens`` tokens
    Preempt(id)            each running request
    Finish(id)             each request

With cache features (the model is ``GroupCacheModel``: KV-cache groups, chunked prefill,
drafts, extra keys, connector tokens, ``Config.max_model_len``) and a configuration that is
not the plain one (``Bounds.features``; ``widened`` turns them on for steps that use them),
as ``FeatureCacheMachine``:

    Admit(new id, prompt, chunk, extra, external)  prompts ``feature_prompts`` (the four
                           and ``A B C``), also with each of ``admit_options`` (default
                           ``default_admit_options``: chunks of one token and one block,
                           ``lora:A``, ``salt:s``, connector tokens of each whole number
                           of blocks and all but the last token; one at a time)
    Admit(id, chunk, external)  re-admission with those chunks / connector tokens too
    Step(id, token, drafts)     only once prefill is done and drafts verified; drafts from
                           ``()`` and ``drafts`` (default ``default_drafts``: 1 token and a block)
    Prefill(id, n)         n from ``prefills`` (default: one block), while prefilling
    Verify(id, accepted)   accepted = 0 .. drafts in flight

The ``max_model_len`` cap is the config's (the model refuses what would pass it).

New requests get fresh ids ``r1, r2, ...`` in order of admission (as the machine does);
``next_request`` says which number is next.

Misuse is excluded: every op returned is valid in the model's state (``misuse_reason``
is None), unless ``Bounds.misuse`` asks for the pool-level misuse calls too. The search
keeps the model's answer for each op beside the list (``with_misuses``,
``EnabledOps``) and remembers pool-level lists under ``pool_ops_key``.

Symmetry (``Bounds.symmetry``, on by default): where two ops are images of each other
under a permutation that maps the state to itself, only one is listed. The
permutations used are the ones ``kvspec.mc.canonical`` also factors out, so the result
is unchanged (see that module): at pool level, held blocks with no hash and equal ref
counts are interchangeable (they appear nowhere but in their own ref count), and so
are labels that no block carries, split into those the run has used before and those
it never has; at cache level, waiting requests with the same tokens, prompt and extra
keys are interchangeable. Sequences are then generated so that within each class of
interchangeable items the i-th one used is the class's i-th member, which keeps one
representative of every orbit.
"""
from __future__ import annotations

import marshal
from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional, Sequence

from kvspec.spec.config import Config
from kvspec.mc.prompts import chunks, default_prompts, default_step_tokens  # noqa: F401 (re-exported)
from kvspec.mc.cache_features import (default_admit_options, default_drafts, feature_prompts, per_request, useful,
                                      widened_features)
from kvspec.spec.ops import (Admit, Alloc, Cache, CachePartial, Finish, Free, FreeForeign, Lookup, Op, Prefill, Preempt,
                             Reset, Step, Touch, Verify)


@dataclass(frozen=True)
class Bounds:
    """Finite domains and state constraints of one search (defaults: ``kvspec mc``)."""

    # -- pool level --------------------------------------------------------------
    labels: tuple[str, ...] = ("a", "b")   # hash labels; interchangeable
    max_ref: int = 2                       # constraint: no ref count above this
    max_holders: Optional[int] = None      # constraint: sum of ref counts (None: no bound)
    max_set: int = 2                       # blocks per Free / Touch / Cache
    max_alloc: Optional[int] = None        # Alloc n up to this (None: every free block)
    # -- cache level -------------------------------------------------------------
    requests: int = 2                      # requests alive at once (--requests)
    prompts: Optional[tuple[tuple[int, ...], ...]] = None   # None: default_prompts(block_size)
    more_prompts: tuple[tuple[int, ...], ...] = ()          # added to the default prompts (widened)
    step_tokens: Optional[tuple[int, ...]] = None           # None: default_step_tokens(block_size)
    max_tokens: Optional[int] = None       # constraint: tokens per request (None: no bound)
    # -- cache level, targets with cache features (their model has ``prefilling``) ----
    # Whether the ops below are enumerated. None: where the model has the features and the
    # config is not the plain one (KV-cache groups other than "full", or a max_model_len),
    # so a plain configuration keeps the old, much smaller state space (and its proofs).
    features: Optional[bool] = None
    # Admit variants (chunk, extra keys, connector tokens) besides the plain one; None:
    # default_admit_options(block_size), one feature at a time.
    admit_options: Optional[tuple[tuple[Optional[int], Optional[str], int], ...]] = None
    drafts: Optional[tuple[tuple[int, ...], ...]] = None    # Step drafts besides (); None: default_drafts
    prefills: Optional[tuple[int, ...]] = None              # Prefill n; None: (block_size,)
    # -- both --------------------------------------------------------------------
    symmetry: bool = True                  # factor out interchangeable blocks, labels, requests
    misuse: bool = False                   # pool level: add the machine's misuse calls

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    def widened(self, steps: Sequence[Op], config: Config) -> "Bounds":
        """These bounds, widened just enough that ``steps`` lies inside the domains."""
        b = self
        step_labels = list(dict.fromkeys(h for op in steps for h in _labels_of(op)))
        labels = step_labels + [x for x in b.labels if x not in step_labels]
        labels = labels[:max(len(b.labels), len(step_labels))]   # interchangeable: only the count matters
        # Prompts the steps add go on top of the default ones (which depend on the model's
        # features: ``feature_prompts``), or of ``prompts`` where those are given.
        prompts = list(b.prompts if b.prompts is not None else default_prompts(config.block_size) + b.more_prompts)
        tokens = list(b.step_tokens if b.step_tokens is not None else default_step_tokens(config.block_size))
        max_set, live, max_live = b.max_set, set(), b.requests
        for op in steps:
            if isinstance(op, (Free, Touch, Cache)):
                max_set = max(max_set, len(op.blocks))
            if isinstance(op, Admit) and op.prompt is not None:
                if op.prompt not in prompts:
                    prompts.append(op.prompt)
                live.add(op.req)
                max_live = max(max_live, len(live))
            if isinstance(op, Finish):
                live.discard(op.req)
            if isinstance(op, Step) and op.token not in tokens:
                tokens.append(op.token)
        b = widened_features(b, steps, config)
        if b.prompts is None:
            extra_prompts = tuple(p for p in prompts if p not in default_prompts(config.block_size))
            b = replace(b, more_prompts=extra_prompts)
        else:
            b = replace(b, prompts=tuple(prompts))
        return replace(b, labels=tuple(labels), max_set=max_set, step_tokens=tuple(tokens),
                       requests=max_live, max_ref=max(b.max_ref, _max_ref(steps, config)),
                       max_holders=None, max_tokens=None, max_alloc=None)


def _labels_of(op: Op) -> tuple[str, ...]:
    if isinstance(op, (Cache, CachePartial)):
        return op.hashes
    if isinstance(op, Lookup):
        return (op.hash,)
    return ()


def _max_ref(steps: Sequence[Op], config: Config) -> int:
    """The largest ref count a pool-level step list reaches (valid steps only)."""
    if config.level != "pool":
        return 0
    from kvspec.spec.model import PoolModel
    from kvspec.targets.base import Traits
    m = PoolModel(config, Traits())
    top = 0
    for op in steps:
        if m.misuse_reason(op) is None:
            m.apply(op)
            top = max(top, max(m.ref, default=0))
    return top


# -- canonical sequences -----------------------------------------------------------
def _sequences(items: Sequence[int], cls: dict[int, int], max_len: int, symmetry: bool) -> Iterable[tuple[int, ...]]:
    """Ordered sequences of distinct ``items``, length 1..max_len.

    With ``symmetry``, items with the same class (``cls[item]``, or no entry: a class of
    its own) are interchangeable: the i-th item of a class used in a sequence is always
    that class's i-th member, so one sequence per orbit is produced."""
    if not symmetry:
        members = {it: [it] for it in items}
        key = {it: it for it in items}
    else:
        members: dict = {}
        key = {}
        for it in items:
            k = cls.get(it, ("own", it))
            key[it] = k
            members.setdefault(k, []).append(it)
    classes = list(members)
    used = {k: 0 for k in classes}
    out: list[tuple[int, ...]] = []
    seq: list[int] = []

    def rec() -> None:
        if seq:
            out.append(tuple(seq))
        if len(seq) == max_len:
            return
        for k in classes:
            i = used[k]
            if i < len(members[k]):
                used[k] += 1
                seq.append(members[k][i])
                rec()
                seq.pop()
                used[k] -= 1

    rec()
    return out


def _label_tuples(n: int, present: Sequence[str], absent_classes: Sequence[Sequence[str]],
                  symmetry: bool) -> list[tuple[str, ...]]:
    """Label tuples of length n (repeats allowed). Present labels are each their own;
    within an absent class the j-th distinct label used is the class's j-th member."""
    if not symmetry:
        pool = list(present) + [x for c in absent_classes for x in c]
        out: list[tuple[str, ...]] = [()]
        for _ in range(n):
            out = [t + (x,) for t in out for x in pool]
        return out
    res: list[tuple[str, ...]] = []

    def rec(t: tuple[str, ...], used: tuple[int, ...]) -> None:
        if len(t) == n:
            res.append(t)
            return
        for x in present:
            rec(t + (x,), used)
        for ci, c in enumerate(absent_classes):
            for j in range(min(used[ci] + 1, len(c))):
                nu = used if j < used[ci] else used[:ci] + (used[ci] + 1,) + used[ci + 1:]
                rec(t + (c[j],), nu)

    rec((), tuple(0 for _ in absent_classes))
    return res


# -- pool level --------------------------------------------------------------------
def enabled_pool_ops(model, config: Config, bounds: Bounds = Bounds(), used_labels: Iterable[str] = ()) -> list[Op]:
    """Every valid pool-level op in ``model``'s state, within ``bounds``.

    ``used_labels``: labels the run has cached before (the session's hash history); they
    are told apart from never-used ones, which keeps the symmetry reduction exact."""
    m = model
    sym = bounds.symmetry
    ops: list[Op] = []
    usable = range(1 if m.null == 0 else 0, m.n)
    ref, hsh = m.ref, m.hash
    holders = sum(ref)
    room = None if bounds.max_holders is None else bounds.max_holders - holders
    free = len(m.queue)
    top = free if bounds.max_alloc is None else min(free, bounds.max_alloc)
    if room is not None:
        top = min(top, room)
    ops += [Alloc(n) for n in range(1, top + 1)]

    held = [b for b in usable if ref[b] > 0]
    # Held blocks without a hash, grouped by ref count, are interchangeable.
    cls = {b: ("held", ref[b]) for b in held if hsh[b] is None}
    for seq in _sequences(held, cls, bounds.max_set, sym):
        ops.append(Free(seq))
    touchable = [b for b in usable if (ref[b] > 0 or hsh[b] is not None) and ref[b] < bounds.max_ref]
    lim = bounds.max_set if room is None else min(bounds.max_set, room)
    for seq in _sequences(touchable, cls, lim, sym):
        ops.append(Touch(seq))

    present = [x for x in bounds.labels if x in m.index]
    hist = set(used_labels)
    absent_used = [x for x in bounds.labels if x not in m.index and x in hist]
    absent_new = [x for x in bounds.labels if x not in m.index and x not in hist]
    absent = [c for c in (absent_used, absent_new) if c]
    if m.caching:
        fresh = [b for b in held if hsh[b] is None]
        for seq in _sequences(fresh, cls, bounds.max_set, sym):
            for labels in _label_tuples(len(seq), present, absent, sym):
                ops.append(Cache(seq, labels))
    ops += [Lookup(x) for x in present]
    ops += [Lookup(c[0]) for c in absent] if sym else [Lookup(x) for c in absent for x in c]
    ops.append(Reset())
    if bounds.misuse:
        ops += _pool_misuse(m, held)
    return ops


def _pool_misuse(m, held: list[int]) -> list[Op]:
    """The machine's misuse rules, one or two representatives each."""
    out: list[Op] = []
    unheld = [b for b in range(1 if m.null == 0 else 0, m.n) if m.ref[b] == 0]
    if held:
        b = held[0]
        out.append(Free((b,) * (m.ref[b] + 1)))                      # double free
        out.append(CachePartial((b,), ()))                           # caching a partial block
    if unheld:
        out.append(Free((unheld[0],)))                               # free of an unheld block
    if m.null is not None:
        out.append(Free((m.null,)))                                  # free of the null block
        out.append(Touch((m.null,)))
    out += [Alloc(-1), Alloc(len(m.queue) + 1), FreeForeign(1)]
    return out


# -- cache level -------------------------------------------------------------------
def enabled_cache_ops(model, config: Config, bounds: Bounds = Bounds(), next_request: int = 1,
                      prompt_lens: Optional[dict[str, int]] = None) -> list[Op]:
    """Every valid cache-level op in ``model``'s state, within ``bounds``.

    ``next_request``: the number of the next fresh request id. ``prompt_lens``: each
    live request's prompt length (waiting requests with equal tokens and prompt are
    interchangeable only if both agree).

    Where the model has cache features (``GroupCacheModel``: groups, chunked prefill,
    drafts, extra keys, connector tokens, the config's ``max_model_len``), as the
    Hypothesis machine's ``FeatureCacheMachine`` draws them: Admit also with each of
    ``admit_options`` (re-admission: its chunk and connector tokens only), Step only for a
    request whose prefill is done and drafts verified, with each of ``drafts`` too,
    Prefill(n) for n in ``prefills`` while a prompt is partly computed, and
    Verify(accepted) for every accepted count 0..k while k drafts are in flight."""
    m = model
    bs = config.block_size
    feat = hasattr(m, "prefilling") and (bounds.features if bounds.features is not None
                                         else config.kv_groups != "full" or config.max_model_len is not None)
    prompts = bounds.prompts if bounds.prompts is not None else \
        tuple(dict.fromkeys((feature_prompts if feat else default_prompts)(bs) + tuple(bounds.more_prompts)))
    tokens = bounds.step_tokens if bounds.step_tokens is not None else default_step_tokens(bs)
    opts: Sequence = ()
    dflt = bounds.admit_options is None
    if feat:
        opts = bounds.admit_options if bounds.admit_options is not None else default_admit_options(bs)
    cap = bounds.max_tokens
    ops: list[Op] = []
    if len(m.reqs) < bounds.requests:
        rid = f"r{next_request}"
        for p in prompts:
            if cap is None or len(p) <= cap:
                ops.append(Admit(rid, p))
                ops += [Admit(rid, p, c, e, x) for c, e, x in per_request(opts, dflt, len(p), bs)
                        if e is not None or useful(c, x, len(p))]
    readmit = list(dict.fromkeys((c, x) for c, _, x in opts))
    waiting = []
    seen_waiting = set()
    for rid, q in m.reqs.items():
        if q.running:
            continue
        sig = (tuple(q.tokens), (prompt_lens or {}).get(rid), repr(getattr(q, "extra", None)))
        if bounds.symmetry and sig in seen_waiting:
            continue
        seen_waiting.add(sig)
        waiting.append(rid)
        ops.append(Admit(rid))
        ops += [Admit(rid, None, c, None, x)
                for c, _, x in per_request(tuple((c, None, x) for c, x in readmit), dflt, len(q.tokens), bs)
                if useful(c, x, len(q.tokens))]
    # The engine's protocol: no Step for a request whose last allocation was refused, until
    # it is preempted and admitted again (both models' ``steppable``; the group model's
    # also waits for Prefill and Verify).
    steppable = m.steppable() if hasattr(m, "steppable") else \
        [r for r, q in m.reqs.items() if q.running and q.computed >= len(q.tokens)]
    drafts = ((),) + tuple(bounds.drafts if bounds.drafts is not None else default_drafts(bs)) if feat else ((),)
    for rid in steppable:
        n = len(m.reqs[rid].tokens)
        ops += [Step(rid, t, d) for d in drafts if cap is None or n + 1 + len(d) <= cap for t in tokens]
    if feat:
        prefills = bounds.prefills if bounds.prefills is not None else (bs,)
        ops += [Prefill(rid, k) for rid in m.prefilling() for k in prefills]
        ops += [Verify(rid, a) for rid in m.drafting() for a in range(len(m.reqs[rid].drafts) + 1)]
    ops += [Preempt(rid) for rid, q in m.reqs.items() if q.running]
    shown = set(waiting)
    ops += [Finish(rid) for rid, q in m.reqs.items() if q.running or rid in shown]
    return ops


def enabled_ops(model, config: Config, bounds: Bounds = Bounds(), **extra) -> list[Op]:
    """The valid ops of ``config.level`` enabled in ``model``'s state (see the module doc)."""
    if config.level == "cache":
        return enabled_cache_ops(model, config, bounds, **{k: v for k, v in extra.items()
                                                           if k in ("next_request", "prompt_lens")})
    return enabled_pool_ops(model, config, bounds, **{k: v for k, v in extra.items() if k == "used_labels"})


# -- what the search remembers of a state's ops ---------------------------------------
def pool_ops_key(m: Any, used: Any, labels: tuple) -> Optional[bytes]:
    """What ``enabled_pool_ops`` reads of a state, besides the search's fixed config and
    bounds: the model's ref counts and hashes, its queue's length, which labels its index
    holds and which labels the hash history has seen (as sets: it only asks ``in``).
    Equal bytes, equal inputs, so the same ops (immutable) are handed out again."""
    if type(m.ref) is not list or type(m.hash) is not list:
        return None   # the incremental session's TrackedLists: no memo
    try:
        return marshal.dumps((m.ref, m.hash, len(m.queue), [x in m.index for x in labels],
                              [x in used for x in labels], len(m.index)), 2)
    except ValueError:
        return None   # a model hash marshal cannot write


class EnabledOps(list):
    """The ops a state enables, with ``misuses``: what the model's ``misuse_reason`` says
    of each, asked once when the list is made and handed to ``Session.apply``. At pool
    level a list is remembered under ``pool_ops_key``, which holds everything
    ``PoolModel.misuse_reason`` reads besides the fixed config (ref counts, hashes, the
    free count), so the answers hold for every state that finds the list there."""

    misuses: tuple = ()


def with_misuses(model: Any, ops: list[Op], unsupported: Any) -> EnabledOps:
    # ops the target has no API for are never tried (Traits.unsupported_ops)
    out = EnabledOps([op for op in ops if type(op).__name__ not in unsupported] if unsupported else ops)
    out.misuses = tuple([model.misuse_reason(op) for op in out])
    return out
