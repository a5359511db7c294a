"""State keys for the model checker: one canonical form per class of symmetric states.

A state of a search is a whole ``Session`` after some ops: the target (read through
its normalized ``Observation``), the reference model, and the check state that the
invariants carry from step to step (``HashMap``: target hash <-> model content; at
cache level also ``ShadowKV``: which content each KV slot holds). The key holds all
of it, so two states with equal keys are indistinguishable to every later check:

* the model's state (ref counts, hashes, queue, index; requests with their tokens,
  prompt length, tables and counters);
* the target's observation, in full (blocks, queue, index, free count, request
  tables and computed counts, queue problems), not just the parts that the model
  predicts: a target may differ from the model where no invariant looks (the order
  of blocks under one hash, say) and that difference can matter later;
* the hash history (every target hash / content pair seen so far) and, at cache
  level, the shadow KV store, stale slots included.

What is canonicalized, and why that is sound
--------------------------------------------
The key is the state *rewritten under a renaming*, never a summary of it: every
component above appears in full, with block ids, hash labels, target hash values
and request ids replaced by canonical names. So equal keys mean the two states are
images of one another under a renaming; merging them is exact as long as the target
treats those names as names (it behaves the same after a consistent renaming):

* **Block ids** (the null block stays fixed). Ids are observable through the queue
  order, the tables and the index, so they are not sorted away: blocks are numbered
  in order of first appearance in a traversal whose order comes from the state's
  structure, not from the ids. Pool level: the free queue front to back, then the
  blocks under each hash label (labels in canonical order, blocks in index order),
  then held blocks without a hash by ref count. Cache level: the request tables
  (requests in canonical order), then the free queue. Ties left after that (equal
  ref counts, say) are broken by the old id. Such a tie can make two symmetric states
  get different keys (less reduction), never two different states the same key.
* **Hash labels** at pool level (``Cache``/``Lookup`` arguments): numbered by first
  appearance in the same traversal; labels that only the hash history knows come
  last, in name order.
* **Target hash values**: opaque; numbered by first appearance walking the observed
  blocks in canonical order, then the observed index, then the history. At cache
  level they are kept as they are: there they are a function of the tokens, which are
  not renamed.
* **Request ids** at cache level: requests are put in an order given by their
  contents (running or waiting, tokens, prompt length, computed counts, table length),
  ties by old id.

Not renamed: tokens and content keys (the prompts and decode tokens are a fixed set,
and a hash chain is not symmetric in them), ref counts, and everything positional.
(The model's free queue is written as its length only: after the renaming it is
always ``1, 2, ..., len``, so the length is all of it.)

What the renaming assumes: the target's behaviour does not depend on which id a block
has (besides the null block), which string a label or request id is, or the value of
a hash (only on equality). Every allocator in vLLM's design (a queue, a dict) meets
this; one that, say, prefers low block ids does not, and must be searched with
``Bounds(symmetry=False)``, which keys on the raw state. Like any explicit-state
checker of real code, the search also assumes that a target's future is determined
by what it was told (the model side of the key) and what it shows (the observation).
"""
from __future__ import annotations

import marshal
from typing import Any, Hashable, Optional

from kvspec.mc.fingerprint import fingerprint
from kvspec.spec.observation import Observation


def state_key(session, extra: Optional[dict] = None, symmetry: bool = True) -> Hashable:
    """The canonical key of a session's state (``extra``: the search's own per-state
    bookkeeping, e.g. prompt lengths at cache level)."""
    if session.config.level == "cache":
        return cache_key(session.model, session.obs, session.hashes, session.shadow,
                         (extra or {}).get("prompt_lens", {}), symmetry)
    return pool_key(session.model, session.obs, session.hashes, symmetry)


# -- shared helpers -------------------------------------------------------------------
def _obs_part(obs: Observation, order: list[int], bmap: dict, thmap: dict, rmap: Optional[dict]) -> tuple:
    """The observation rewritten under ``bmap`` (blocks), ``thmap`` (target hashes,
    extended here) and ``rmap`` (request ids)."""
    ob = obs.blocks
    if len(ob) != len(order):
        return ("raw", _raw_obs(obs))
    rows = []
    for b in order:  # hashes numbered in block order as the rows are written
        s = ob[b]
        h = s.hash
        if h is None:
            rows.append((s.ref, -1, s.queued))
        else:
            t = thmap.get(h)
            if t is None:
                t = thmap[h] = len(thmap)
            rows.append((s.ref, t, s.queued))
    blocks = tuple(rows)
    stale = [h for h in obs.index if h not in thmap]
    if stale:
        stale.sort(key=lambda h: (tuple(sorted(bmap.get(b, -1) for b in obs.index[h])), repr(h)))
        for h in stale:
            thmap[h] = len(thmap)
    get = bmap.get
    queue = tuple([get(b, ("?", b)) for b in obs.queue])
    index = tuple(sorted([(thmap[h], tuple([get(b, ("?", b)) for b in ids])) for h, ids in obs.index.items()]))
    reqs: Any = ()
    if obs.requests:
        rm = rmap or {}
        reqs = tuple(sorted([(rm.get(r, ("?", r)), tuple([get(b, ("?", b)) for b in rs.table]), rs.computed)
                             for r, rs in obs.requests.items()]))
    return (blocks, queue, index, obs.free_count, reqs, obs.null_block, obs.queue_problems)


def _repr_first(kv: tuple) -> str:
    return repr(kv[0])


def _items(d: dict) -> tuple:
    """A dict's items in a canonical order (keys of mixed types sort by repr)."""
    try:
        return tuple(sorted(d.items()))
    except TypeError:
        return tuple(sorted(d.items(), key=lambda kv: repr(kv[0])))


def compact(key: Hashable) -> bytes:
    """A key as bytes, for storing many (a tenth of the memory of the tuples). Exact for
    keys of tuples, ints, strings, bytes, None and bools, which is what the functions
    here build: equal bytes only for equal keys. (The converse can fail only in ways
    that split one state in two, e.g. a string written once interned and once not,
    which costs time, never soundness.)"""
    try:
        return marshal.dumps(key, 2)
    except ValueError:  # a target's own hash type that marshal cannot write: keep the key as it is
        return key  # type: ignore[return-value]


def _raw_obs(obs: Observation) -> tuple:
    return (tuple((b.ref, b.hash, b.queued) for b in obs.blocks), obs.queue,
            tuple(sorted(obs.index.items(), key=lambda kv: repr(kv[0]))), obs.free_count,
            tuple(sorted((r, rs.table, rs.computed, rs.groups) for r, rs in obs.requests.items())), obs.null_block,
            obs.queue_problems)


# -- pool level -----------------------------------------------------------------------
def pool_key(m, obs: Observation, hashes, symmetry: bool = True) -> Hashable:
    ref, hsh, queue, index = m.ref, m.hash, m.queue, m.index
    n = len(ref)
    t2k = hashes.t2k if hashes is not None else {}
    if not symmetry:
        return (tuple(ref), tuple(hsh), tuple(queue), tuple(sorted((k, tuple(v)) for k, v in index.items())),
                _raw_obs(obs), _items(t2k))
    null = m.null
    order: list[int] = [] if null is None else [null]
    # 1. the free queue, front first; the labels of queued blocks as they appear
    order += queue
    bmap: dict[int, int] = {b: i for i, b in enumerate(order)}
    lmap: dict[Hashable, int] = {}
    for h in [hsh[b] for b in queue]:
        if h is not None and h not in lmap:
            lmap[h] = len(lmap)
    if len(order) < n:
        # 2. labels carried by held blocks only, by the ref counts of their blocks
        if len(lmap) < len(index):
            rest = [x for x in index if x not in lmap]
            if len(rest) > 1:
                rest.sort(key=lambda x: (tuple(ref[b] for b in index[x]), x))
            for x in rest:
                lmap[x] = len(lmap)
        # 3. the blocks under each label, in index order
        for x in sorted(index, key=lmap.__getitem__):
            for b in index[x]:
                if b not in bmap:
                    bmap[b] = len(order)
                    order.append(b)
        # 4. the rest (held, no hash) by ref count; equal ones are interchangeable
        if len(order) < n:
            rem = [b for b in range(n) if b not in bmap]
            rem.sort(key=lambda b: (ref[b], b))
            for b in rem:
                bmap[b] = len(order)
                order.append(b)
    elif len(lmap) < len(index):  # index entries on no block: an inconsistent state
        for x in sorted(index, key=repr):
            if x not in lmap:
                lmap[x] = len(lmap)
    for b in order:  # labels on blocks that the index does not know (an inconsistent state)
        h = hsh[b]
        if h is not None and h not in lmap:
            lmap[h] = len(lmap)
    model = tuple([(ref[b], -1 if hsh[b] is None else lmap[hsh[b]]) for b in order])
    idx = tuple(sorted([(lmap[x], tuple([bmap[b] for b in bs])) for x, bs in index.items()]))
    thmap: dict[Hashable, int] = {}
    opart = _obs_part(obs, order, bmap, thmap, None)
    # history: pairs the run has seen; unknown names numbered in label-name order
    hist: Any = ()
    if t2k:
        pairs = []
        unknown = []
        for th, lab in t2k.items():
            a, c = thmap.get(th), lmap.get(lab)
            if a is None and c is None:
                unknown.append((repr(lab), th, lab))
                continue
            if a is None:  # one side known, the other not: name the unknown side now
                thmap[th] = a = len(thmap)
            if c is None:
                lmap[lab] = c = len(lmap)
            pairs.append((a, c))
        unknown.sort()
        for _, th, lab in unknown:
            thmap[th] = len(thmap)
            lmap[lab] = len(lmap)
            pairs.append((thmap[th], lmap[lab]))
        pairs.sort()
        hist = tuple(pairs)
    return (model, len(queue), idx, opart, hist)


# -- cache level ----------------------------------------------------------------------
def cache_key(m, obs: Observation, hashes, shadow, prompt_lens: dict, symmetry: bool = True) -> Hashable:
    pool = m.pool
    ref, hsh, queue, index = pool.ref, pool.hash, pool.queue, pool.index
    n = len(ref)
    t2k = hashes.t2k if hashes is not None else {}
    slots = shadow.slots if shadow is not None else {}
    reqs = m.reqs
    if not symmetry:
        return (tuple(ref), tuple(hsh), tuple(queue), _items({k: tuple(v) for k, v in index.items()}),
                tuple(sorted((r, tuple(q.tokens), prompt_lens.get(r), q.running, q.computed, tuple(q.table),
                              q.num_cached, repr(getattr(q, "more", None)), _features(q))
                             for r, q in reqs.items())),
                _raw_obs(obs), _items(t2k), _items(slots))
    # requests in an order given by their contents; ties by old id
    rids = sorted(reqs, key=lambda r: (not reqs[r].running, reqs[r].tokens, prompt_lens.get(r, -1),
                                       reqs[r].computed, reqs[r].num_cached, len(reqs[r].table),
                                       _features(reqs[r]), r)) \
        if len(reqs) > 1 else list(reqs)
    rmap = {r: i for i, r in enumerate(rids)}
    null = pool.null
    bmap: dict[int, int] = {}
    if null is not None:
        bmap[null] = null
    nxt = 0 if null is None else 1
    for r in rids:
        for t in _tables(reqs[r]):  # every KV-cache group's table, group 0 first
            for b in t:
                if b not in bmap:
                    bmap[b] = nxt
                    nxt += 1
    for b in queue:
        if b not in bmap:
            bmap[b] = nxt
            nxt += 1
    if nxt < n:
        for b in range(n):
            if b not in bmap:
                bmap[b] = nxt
                nxt += 1
    order = [0] * n
    for b, nb in bmap.items():
        order[nb] = b
    model = (tuple([(ref[b], hsh[b]) for b in order]),
             tuple([bmap[b] for b in queue]),
             _items({k: tuple([bmap[b] for b in bs]) for k, bs in index.items()}),  # keys of mixed types with groups
             tuple([(tuple(q.tokens), prompt_lens.get(r, -1), q.running, q.computed, q.num_cached,
                     tuple([tuple([bmap[b] for b in t]) for t in _tables(q)]), _features(q))
                    for r, q in [(r, reqs[r]) for r in rids]]))
    # target hashes are functions of the tokens here: kept, only blocks and requests are renamed
    ob = obs.blocks
    if len(ob) == n:
        get = bmap.get
        opart: Any = (tuple([(s.ref, s.hash, s.queued) for s in [ob[b] for b in order]]),
                      tuple([get(b, ("?", b)) for b in obs.queue]),
                      tuple(sorted([(h, tuple([get(b, ("?", b)) for b in ids])) for h, ids in obs.index.items()],
                                   key=_repr_first)),
                      obs.free_count,
                      tuple(sorted([(rmap.get(r, ("?", r)), tuple([get(b, ("?", b)) for b in rs.table]), rs.computed,
                                     tuple([tuple([get(b, ("?", b)) for b in t]) for t in rs.groups]))
                                    for r, rs in obs.requests.items()])),
                      obs.null_block, obs.queue_problems)
        shadow_part = tuple(sorted([((get(b, ("?", b)), off), content) for (b, off), content in slots.items()]))
    else:
        opart = ("raw", _raw_obs(obs))
        shadow_part = _items(slots)
    return (model, opart, _items(t2k), shadow_part)


def _tables(q) -> list:
    """A request's tables: group 0's, then those of groups 1.. (``GroupReq.more``)."""
    more = getattr(q, "more", None)
    return [q.table] + list(more) if more else [q.table]


def _features(q) -> tuple:
    """A request's state besides tokens and tables (``GroupReq``: extra keys, drafts in
    flight, where its last schedule began computing, the groups' cached counts); ``()``
    for a plain ``ReqModel``. Not renamed: none of it names a block or a request."""
    if not hasattr(q, "drafts"):
        return ()
    return (repr(q.extra), tuple(q.drafts), q.computing_from, tuple(q.more_cached))


# -- remembering keys per exact state ------------------------------------------------------
class KeyMemo:
    """``compact(state_key(...))``, remembered per *exact* state.

    Most transitions of a search land on a state that some earlier transition reached
    with the very same ids, labels and hashes (at pool level about three in four), and
    the canonical key is a pure function of the state. So the key is kept under the
    state's raw form: the marshalled bytes of every input that ``pool_key`` /
    ``cache_key`` reads (the model's ref counts, hashes, queue and index, and requests;
    the whole observation; the hash history; the shadow KV store; the prompt lengths),
    containers in their own order. Equal raw bytes mean equal inputs, so the memo never
    changes a key: it only skips recomputing one. (Keep ``_raw_*`` in step with the key
    functions above: every input they read must be in the raw form.) A state that
    marshal cannot write (a target's own hash type) is keyed without the memo. The memo
    holds at most ``limit`` entries (about half a KiB each at pool level, so about
    130 MiB at the default) and then starts afresh, so it cannot push a search into
    the memory cap much sooner. It is on by default at pool level only: at cache level
    fewer transitions revisit an exact state and the raw form costs nearly as much as
    the key (cache level, 3 blocks, depth 6: no measurable gain).
    """

    def __init__(self, level: str, symmetry: bool = True, limit: int = 1 << 18, fingerprints: bool = False) -> None:
        self.level = level
        self.symmetry = symmetry
        self.fingerprints = fingerprints   # keep and return the key's 64-bit fingerprint (kvspec.mc.fingerprint)
        self.limit = limit      # entries kept at most (then the memo starts afresh)
        self.memo: dict = {}
        self.hits = 0
        self.misses = 0

    def __call__(self, session, extra: Optional[dict] = None) -> Hashable:
        try:
            raw = _raw_cache(session, extra) if self.level == "cache" else _raw_pool(session)
        except (ValueError, TypeError, AttributeError):
            raw = None
        if raw is not None:
            k = self.memo.get(raw)
            if k is not None:
                self.hits += 1
                return k
        self.misses += 1
        k = compact(state_key(session, extra, self.symmetry))
        if self.fingerprints:
            k = fingerprint(k)
        if raw is not None:
            if len(self.memo) >= self.limit:
                self.memo.clear()
            self.memo[raw] = k
        return k


def _raw_obs_parts(o: Observation) -> tuple:
    return ([(b.ref, b.hash, b.queued) for b in o.blocks], o.queue, o.index, o.free_count, o.null_block,
            o.queue_problems, [(r, rs.table, rs.computed, rs.groups) for r, rs in o.requests.items()] if o.requests else None)


def _raw_pool(s) -> Optional[bytes]:
    m, h = s.model, s.hashes
    return marshal.dumps((m.ref, m.hash, m.queue, m.index, _raw_obs_parts(s.obs),
                          None if h is None else h.t2k), 2)


def _raw_cache(s, extra: Optional[dict]) -> Optional[bytes]:
    m, h, sh = s.model, s.hashes, s.shadow
    p = m.pool
    reqs = [(r, q.tokens, q.running, q.computed, q.num_cached, q.table, getattr(q, "more", None), _features(q))
            for r, q in m.reqs.items()]
    return marshal.dumps((p.ref, p.hash, p.queue, p.index, reqs, (extra or {}).get("prompt_lens", {}),
                          _raw_obs_parts(s.obs), None if h is None else h.t2k, None if sh is None else sh.slots), 2)
