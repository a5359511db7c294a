"""The invariant catalogue: stable ids, what each one means, and its check.

Every check reads one ``StepContext`` (the op just run, the target's observation
before and after, the reference model after, what the target returned and what the
model expected) and returns a list of ``Violation``. ``check_step`` runs them all
and orders the result by ``PRIORITY``: the most specific finding first, the
symptoms (wrong KV, wrong order) last, so a report names the cause.

This module is longer than 450 lines on purpose: it is the whole catalogue, one place a
reader finds every check.
"""
from __future__ import annotations

import os

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from kvspec.spec.config import Config
from kvspec.spec.model import CacheModel, PoolModel
from kvspec.spec.model.groups import lost_identity
from kvspec.spec.observation import Observation
from kvspec.spec.blame import crash_words
from kvspec.spec.misuse import documented_errors
from kvspec.spec.ops import Admit, Alloc, Lookup, Op, Prefill, Reset, Step
from kvspec.spec.shadow import HashMap, ShadowKV
from kvspec.spec.violation import Violation
from kvspec.spec.group_checks import tables_differ as _tables_differ, window_reused as _window_reused

CATALOGUE: dict[str, str] = {
    "I1": "A non-null block is in the free queue iff its ref_cnt is 0; no duplicates; links agree with the walk.",
    "I2": "A held block id never changes under its request; tables are append-only; held blocks are never deduplicated.",
    "I3": "Only full blocks carry a hash or appear in the index; a held block's hash is set once.",
    "I4": "A cached block with ref 0 stays in the queue and the index until allocation pops it or touch revives it.",
    "ACCOUNTING": "The free count equals the queue length and the number of non-null ref-0 blocks; ref counts equal holders, never negative.",
    "INDEX_CONSISTENT": "Every index entry h -> b has b.hash == h, and every hashed block is in the index.",
    "HASH_CHAIN": "A block's hash covers every token of every block before it (and the extra keys): equal hash iff equal prefix.",
    "EVICTION_ORDER": "The free queue order, and so which blocks allocation returns, equals the reference model's policy (free order \"any\": allocation takes free blocks only).",
    "NULL_BLOCK": "Block 0 is reserved: never handed out, queued, hashed or counted.",
    "KV_INTEGRITY": "Every KV slot a request reads holds KV computed for exactly that request's token prefix.",
    "MAX_HIT": "A prefix hit is block-aligned, contiguous from block 0, and never covers the whole prompt.",
    "MIN_HIT": "A prefix hit the reference model proves every group can serve is taken (under EAGLE/MTP: the longest hit whose next block is cached too, dropped once).",
    "NO_LEAK": "With no request running every block is free; admission fails only when blocks really are too few.",
    "ATOMIC_REJECT": "A misuse is rejected with a documented error and leaves the observed state unchanged.",
    "NO_CRASH": "A valid operation never raises.",
    "NO_HANG": "Every target call returns within the op timeout (--op-timeout).",
    "HIT_AGREEMENT": "With several KV-cache groups, every group's prefix hit covers exactly the hit length the groups agreed on.",
    "WINDOW": "Every block a still-needed token attends to (its window included) is held; blocks wholly outside every window are null or freed.",
    "SLOTS": "Every scheduled token, draft tokens included, has a slot in every group's table, within the max_model_len cap.",
    "PRIORITY": "Under the priority policy the engine preempts the running request last in (priority, arrival) order.",
    "COMMON_PREFIX": "The common-prefix block count a scheduler reports (cascade attention's) counts leading blocks that every request in the step's batch holds, the same ids in the same places.",
    "COPY_ON_WRITE": "A fork shares every block with one holder more and takes none; a write into a block another sequence holds copies it first (the copy reported); freeing the child restores every count.",
}
# The four numbered invariants also have names; the others are their own name.
NAMES: dict[str, str] = {"I1": "QUEUE_IFF_FREE", "I2": "STABLE_IDS", "I3": "FULL_ONLY", "I4": "CACHED_EVICTABLE"}


def title(invariant: str) -> str:
    """``I4 CACHED_EVICTABLE`` style label; ids and names are stable."""
    name = NAMES.get(invariant, "")
    return invariant if name in ("", invariant) else f"{invariant} {name}"


PRIORITY = [
    "NO_HANG", "NO_CRASH", "NULL_BLOCK", "ATOMIC_REJECT", "COPY_ON_WRITE", "I1", "HIT_AGREEMENT", "WINDOW", "SLOTS",
    "HASH_CHAIN", "MAX_HIT", "MIN_HIT", "INDEX_CONSISTENT", "I3", "I4", "ACCOUNTING", "NO_LEAK", "I2", "EVICTION_ORDER",
    "KV_INTEGRITY", "PRIORITY", "COMMON_PREFIX",
]


@dataclass
class StepContext:
    op: Op
    config: Config
    traits: Any
    prev: Observation
    obs: Observation
    model: Any                      # PoolModel or CacheModel, after the op
    misuse: Optional[str] = None    # why the op is a misuse, or None
    error: Optional[BaseException] = None
    result: Any = None
    expected: Any = None
    shadow: Optional[ShadowKV] = None
    hashes: Optional[HashMap] = None

    @property
    def pool(self) -> PoolModel:
        return self.model.pool if isinstance(self.model, CacheModel) else self.model

    @property
    def comparable(self) -> bool:
        """Can the model's state be compared with the target's after this step?

        Not when the op was a misuse or raised, nor when the target already decided
        differently from the model (other blocks allocated, an admission refused):
        then the one check that owns that decision reports it, and comparing the
        rest would only repeat it as noise."""
        if self.misuse is not None or self.error is not None:
            return False
        if isinstance(self.op, (Alloc, Admit)):
            return self.result == self.expected
        if isinstance(self.op, (Step, Prefill)):
            return (_refused(self.result)) == (_refused(self.expected))
        return True

    def v(self, inv: str, message: str, blocks=(), requests=()) -> Violation:
        return Violation(inv, message, self.obs.excerpt(blocks, requests))


Check = Callable[[StepContext], list[Violation]]
CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    CHECKS.append(fn)
    return fn


def _refused(result: Any) -> bool:
    """Admit and Step results: None / False mean refused (0 hit tokens is a success)."""
    return result is None or result is False


def _valid(ctx: StepContext) -> bool:
    return ctx.misuse is None and ctx.error is None


_KVSPEC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kvspec's own package
_IMPL_DIR = os.path.join(_KVSPEC_DIR, "impl")  # the bundled allocator: code under test, not kvspec's


def user_frames(e: BaseException, limit: int = 3) -> str:
    """Where the target raised: the last ``limit`` frames of the traceback that are not
    kvspec's own (its drivers, session and watchdog), innermost first, as ``file:line in
    function``; "" when none is left."""
    import traceback

    def ours(path: str) -> bool:
        p = os.path.abspath(path)
        return p.startswith(_KVSPEC_DIR + os.sep) and not p.startswith(_IMPL_DIR + os.sep)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not ours(f.filename)][-limit:]
    return ", called from ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in reversed(frames))


@check
def no_crash(ctx: StepContext) -> list[Violation]:
    if ctx.misuse is None and ctx.error is not None:
        e = ctx.error
        # where it was raised, and the caller that passed a value its callee rejects (kvspec.spec.blame);
        # then the user's own frames of the traceback
        words, where, caller = crash_words(e, tuple(getattr(ctx.traits, "misuse_errors", ()) or ()))
        frames = user_frames(e)
        v = ctx.v("NO_CRASH", f"{ctx.op!r} is valid here but the target raised {type(e).__name__}: {e}{words}"
                  + (f" (at {frames})" if frames else ""))
        return [replace(v, where=where, caller=caller)]
    return []


@check
def atomic_reject(ctx: StepContext) -> list[Violation]:
    if ctx.misuse is None:
        return []
    if ctx.error is None:
        return [ctx.v("ATOMIC_REJECT", f"{ctx.op!r} is a misuse ({ctx.misuse}) but the target accepted it")]
    out = []
    documented = documented_errors(ctx.traits, ctx.misuse)  # the class declared for this kind of misuse
    if documented and not isinstance(ctx.error, documented):
        out.append(ctx.v("ATOMIC_REJECT", f"{ctx.op!r} ({ctx.misuse}) raised {type(ctx.error).__name__}, "
                                          f"not one of the documented errors"))
    if _state(ctx.obs) != _state(ctx.prev):
        out.append(ctx.v("ATOMIC_REJECT", f"{ctx.op!r} ({ctx.misuse}) was rejected but changed the state "
                                          f"(before: {ctx.prev.excerpt()})"))
    return out


def _state(o: Observation):
    return (o.blocks, o.queue, tuple(sorted((repr(k), v) for k, v in o.index.items())), o.free_count,
            tuple(sorted(o.requests.items())))


@check
def null_block(ctx: StepContext) -> list[Violation]:
    n = ctx.obs.null_block
    if n is None:
        return []
    out = []
    if n in ctx.obs.queue:
        out.append(ctx.v("NULL_BLOCK", f"the null block {n} is in the free queue", [n]))
    if ctx.obs.blocks[n].hash is not None or any(n in ids for ids in ctx.obs.index.values()):
        out.append(ctx.v("NULL_BLOCK", f"the null block {n} carries a hash", [n]))
    if isinstance(ctx.op, Alloc) and isinstance(ctx.result, tuple) and n in ctx.result:
        out.append(ctx.v("NULL_BLOCK", f"allocation handed out the null block {n}", [n]))
    windowed = [not g.whole for g in getattr(ctx.model, "groups", ())]  # their tables hold null where freed
    for rid, rs in ctx.obs.requests.items():
        if n in rs.table and not (windowed and windowed[0]):
            out.append(ctx.v("NULL_BLOCK", f"request {rid} holds the null block {n}", [n], [rid]))
    return out


@check
def adapter_probes(ctx: StepContext) -> list[Violation]:
    """What the adapter's own probes found (``Observation.found``: copy-on-write)."""
    return [ctx.v(inv, message) for inv, message in ctx.obs.found]


@check
def queue_iff_free(ctx: StepContext) -> list[Violation]:
    o = ctx.obs
    out = [ctx.v("I1", f"the free queue is corrupt: {p}") for p in o.queue_problems]
    dup = [b for b, c in Counter(o.queue).items() if c > 1]
    if dup:
        out.append(ctx.v("I1", f"block {dup[0]} appears {Counter(o.queue)[dup[0]]} times in the free queue", dup))
    for b in o.usable_ids():
        s = o.blocks[b]
        if s.queued and s.ref != 0:
            out.append(ctx.v("I1", f"block {b} has ref_cnt {s.ref} but is in the free queue", [b]))
        elif not s.queued and s.ref == 0:
            out.append(ctx.v("I1", f"block {b} has ref_cnt 0 but is not in the free queue", [b]))
    return out


@check
def accounting(ctx: StepContext) -> list[Violation]:
    o, out = ctx.obs, []
    zero = sum(1 for b in o.usable_ids() if o.blocks[b].ref == 0)
    if o.free_count != len(o.queue) or o.free_count != zero:
        out.append(ctx.v("ACCOUNTING", f"the free count is {o.free_count} but the queue holds {len(o.queue)} "
                                       f"and {zero} blocks have ref_cnt 0"))
    neg = [b for b in o.usable_ids() if o.blocks[b].ref < 0]
    if neg:
        out.append(ctx.v("ACCOUNTING", f"block {neg[0]} has a negative ref_cnt {o.blocks[neg[0]].ref}", neg[:1]))
    if o.requests or isinstance(ctx.model, CacheModel):
        holders = Counter(b for rs in o.requests.values() for t in (rs.table,) + tuple(rs.groups) for b in t)
        what = "tables that hold it"
    elif ctx.comparable:
        holders = Counter({b: r for b, r in enumerate(ctx.pool.ref) if r})
        what = "holders"
    else:
        holders, what = None, ""
    for b in (o.usable_ids() if holders is not None else ()):
        if b not in neg:
            if o.blocks[b].ref != holders.get(b, 0):
                out.append(ctx.v("ACCOUNTING", f"block {b} has ref_cnt {o.blocks[b].ref} but {holders.get(b, 0)} {what}", [b]))
                break
    return out


@check
def accounting_step(ctx: StepContext) -> list[Violation]:
    # ACCOUNTING's part that reads the step (op, result, expected), apart from the part
    # above that reads the state, so the model checker can check a state once (kvspec.mc.split)
    out = []
    if _valid(ctx) and isinstance(ctx.op, Reset) and ctx.result != ctx.expected:
        out.append(ctx.v("ACCOUNTING", f"reset_prefix_cache returned {ctx.result}; expected {ctx.expected}"))
    if _valid(ctx) and isinstance(ctx.op, (Admit, Step, Prefill)) and _refused(ctx.expected) and not _refused(ctx.result):
        out.append(ctx.v("ACCOUNTING", f"{ctx.op!r} was admitted although too few blocks were free", requests=[ctx.op.req]))
    return out


@check
def index_consistent(ctx: StepContext) -> list[Violation]:
    o, out = ctx.obs, []
    for h, ids in o.index.items():
        for b in ids:
            if not 0 <= b < len(o.blocks) or o.blocks[b].hash != h:
                out.append(ctx.v("INDEX_CONSISTENT", f"the index maps hash {o.short_hash(h)} to block {b}, "
                                                     f"whose hash is {o.short_hash(o.blocks[b].hash) if 0 <= b < len(o.blocks) else '?'}", [b]))
                return out
    for b in o.usable_ids():
        h = o.blocks[b].hash
        if h is not None and b not in o.index.get(h, ()) and not _entry_replaced(ctx, b):
            out.append(ctx.v("INDEX_CONSISTENT", f"block {b} has hash {o.short_hash(h)} but is not in the index", [b]))
            break
    return out


def _entry_replaced(ctx: StepContext, b: int) -> bool:
    """One block per hash (index_latest_wins, nano-vllm's dict; index_first_wins): a held
    block may lack its entry where the model's index lacks it too."""
    one_per_hash = getattr(ctx.traits, "index_latest_wins", False) or getattr(ctx.traits, "index_first_wins", False)
    if not one_per_hash or ctx.obs.blocks[b].ref <= 0:
        return False
    if getattr(ctx.traits, "partial_block_caching", False) and ctx.hashes is not None \
            and ctx.hashes.key_of(ctx.obs.blocks[b].hash) is None:
        return True  # a partial block's hash (declared), which the model does not track: the entry may have moved on
    key = ctx.pool.hash[b] if ctx.comparable and b < len(ctx.pool.hash) else None
    return not ctx.comparable or (key is not None and b not in ctx.pool.index.get(key, ()))


@check
def hash_chain(ctx: StepContext) -> list[Violation]:
    if ctx.hashes is None or not ctx.comparable or _tables_differ(ctx):
        return []
    o, pool = ctx.obs, ctx.pool
    for b in o.usable_ids():
        h, key = o.blocks[b].hash, pool.hash[b] if b < len(pool.hash) else None
        if h is not None and key is not None:
            had = ctx.hashes.key_of(h)
            problem = ctx.hashes.pair(h, key)
            if problem:
                v = ctx.v("HASH_CHAIN", f"block {b}: {problem}", [b])
                if had is not None and had != key:  # one hash, two contents: which part it lost
                    v = replace(v, where=lost_identity(had, key))
                return [v]
    return []


@check
def full_only(ctx: StepContext) -> list[Violation]:
    o, out = ctx.obs, []
    bs = ctx.config.block_size
    partial = getattr(ctx.traits, "partial_block_caching", False)  # declared: partly filled blocks are hashed
    for rid, rs in o.requests.items():
        for i, b in enumerate(rs.table):
            if partial and i * bs < rs.computed:
                continue  # a partly filled block with computed tokens may carry its content's hash
            if 0 <= b < len(o.blocks) and o.blocks[b].hash is not None and (i + 1) * bs > rs.computed:
                out.append(ctx.v("I3", f"block {b} (block {i} of {rid}) is hashed but holds only "
                                       f"{max(rs.computed - i * bs, 0)} of {bs} computed tokens", [b], [rid]))
                return out
    for b in o.usable_ids():
        before, now = ctx.prev.blocks[b], o.blocks[b]
        if before.ref > 0 and now.ref > 0 and before.hash is not None and now.hash != before.hash \
                and not _window_reused(ctx, b, before.hash) and not (partial and _was_partial(ctx, b)):
            out.append(ctx.v("I3", f"held block {b} changed its hash from {o.short_hash(before.hash)} to "
                                   f"{o.short_hash(now.hash)}", [b]))
            break
    return out


def _was_partial(ctx: StepContext, b: int) -> bool:
    """Was ``b`` a partly filled block of a request before this step (its hash then named
    a partial content, which changes as the block fills: partial_block_caching)?"""
    bs = ctx.config.block_size
    return any(i * bs < rs.computed < (i + 1) * bs
               for rs in ctx.prev.requests.values() for i, x in enumerate(rs.table) if x == b)


@check
def cached_evictable(ctx: StepContext) -> list[Violation]:
    if not _valid(ctx):
        return []
    if isinstance(ctx.op, Lookup) and (ctx.result is None) != (ctx.expected is None):
        return [ctx.v("I4", f"lookup of {ctx.op.hash!r} returned {ctx.result}; the cache holds {ctx.expected}")]
    if isinstance(ctx.op, Lookup) and ctx.result is not None:
        # Found or not is not enough: the block found must be cached under that hash (in the
        # model, and by the target's own hash of it where known).
        b, ok = ctx.result, isinstance(ctx.result, int) and 0 <= ctx.result < len(ctx.obs.blocks)
        holds, seen = (ctx.pool.hash[b], ctx.obs.blocks[b].hash) if ok else (None, None)
        seen_key = ctx.hashes.key_of(seen) if ctx.hashes is not None and seen is not None else None
        if holds != ctx.op.hash or seen is None or seen_key not in (None, ctx.op.hash):
            return [ctx.v("I4", f"lookup of {ctx.op.hash!r} returned block {b}, which is cached under "
                                f"{holds!r}, not {ctx.op.hash!r}", [b] if holds is not None else [])]
    partial = getattr(ctx.traits, "partial_block_caching", False)
    if isinstance(ctx.op, Admit) and isinstance(ctx.result, int) and isinstance(ctx.expected, int) \
            and ctx.result < ctx.expected:
        return [ctx.v("I4", f"{ctx.op.req} hit {ctx.result} tokens but {ctx.expected} were cached", requests=[ctx.op.req])]
    if not ctx.comparable:
        return []
    o, pool = ctx.obs, ctx.pool
    if isinstance(ctx.op, Admit) and isinstance(ctx.result, int) and isinstance(ctx.model, CacheModel):
        # A block the admission hit must keep the hash it was hit by: evicting it first
        # (and perhaps re-caching it as other content) is a lost cached block.
        q = ctx.model.reqs.get(ctx.op.req)
        for b in (q.table[: ctx.result // ctx.config.block_size] if q is not None else ()):
            before = ctx.prev.blocks[b].hash if 0 <= b < len(ctx.prev.blocks) else None
            if before is not None and o.blocks[b].hash != before and b != o.null_block:
                return [ctx.v("I4", f"block {b}, hit by {ctx.op.req}, was evicted during that admission "
                                    f"(hash {o.short_hash(before)} -> {o.short_hash(o.blocks[b].hash)})", [b])]
    for b in o.usable_ids():
        has, should = o.blocks[b].hash is not None, pool.hash[b] is not None
        if has and not should and partial and (ctx.hashes is None or ctx.hashes.key_of(o.blocks[b].hash) is None):
            continue  # a hash no full block's content was paired with: a partial block's (declared)
        if has and not should:
            why = "was popped by allocation" if pool.ref[b] > 0 else "was evicted or reset"
            return [ctx.v("I4", f"block {b} {why} but still carries its hash, so it can still be hit", [b])]
        if should and not has:
            state = "free" if pool.ref[b] == 0 else "held"
            return [ctx.v("I4", f"cached block {b} ({state}) lost its hash before being evicted", [b])]
    return []


@check
def max_hit(ctx: StepContext) -> list[Violation]:
    if not (_valid(ctx) and isinstance(ctx.op, Admit) and isinstance(ctx.result, int)):
        return []
    bs, rid = ctx.config.block_size, ctx.op.req
    n = len(ctx.model.reqs[rid].tokens)
    # partial_block_caching (declared): a hit may end inside a block, by less than a block
    # past the full blocks the model finds cached; KV_INTEGRITY checks every token it covers
    slack = bs - 1 if getattr(ctx.traits, "partial_block_caching", False) else 0
    if ctx.result % bs and not slack:
        return [ctx.v("MAX_HIT", f"{rid} hit {ctx.result} tokens, not a multiple of the block size {bs}", requests=[rid])]
    # Where whole-prompt hits are declared, the last token's KV is read from the cache
    # instead of computed, and KV_INTEGRITY checks that read.
    if ctx.result > n or (ctx.result == n and not getattr(ctx.traits, "whole_prompt_hits", False)):
        return [ctx.v("MAX_HIT", f"{rid} hit all {n} prompt tokens; at least the last must be computed", requests=[rid])]
    if isinstance(ctx.expected, int) and ctx.result > ctx.expected + slack:
        return [ctx.v("MAX_HIT", f"{rid} hit {ctx.result} tokens but only {ctx.expected} are cached from block 0",
                      requests=[rid])]
    return []


@check
def no_leak(ctx: StepContext) -> list[Violation]:
    if not _valid(ctx):
        return []
    o = ctx.obs
    if isinstance(ctx.op, (Admit, Step, Prefill)) and _refused(ctx.result) and not _refused(ctx.expected):
        return [ctx.v("NO_LEAK", f"{ctx.op!r} was refused although enough blocks were free or reclaimable",
                      requests=[ctx.op.req])]
    quiet = not ctx.model.running() if isinstance(ctx.model, CacheModel) else not ctx.pool.held()
    if quiet:
        held = [b for b in o.usable_ids() if o.blocks[b].ref != 0]
        if held:
            return [ctx.v("NO_LEAK", f"nothing is held but block {held[0]} has ref_cnt {o.blocks[held[0]].ref}", held[:1])]
    return []


@check
def stable_ids(ctx: StepContext) -> list[Violation]:
    if not isinstance(ctx.model, CacheModel) or not ctx.comparable:
        return []
    o = ctx.obs
    for rid, rs in o.requests.items():
        before = ctx.prev.requests.get(rid)
        # A window group may swap a block it no longer reads for the null block.
        if before is not None and any(a != b and b != o.null_block for a, b in zip(before.table, rs.table)) \
                or before is not None and len(rs.table) < len(before.table):
            return [ctx.v("I2", f"{rid}'s block table changed under it: {list(before.table)} -> {list(rs.table)}",
                          requests=[rid])]
    owners: dict[int, list[str]] = {}
    for rid, rs in o.requests.items():
        for b in rs.table:
            owners.setdefault(b, []).append(rid)
    for b, rids in owners.items():
        for rid in rids:
            q = ctx.model.reqs.get(rid)
            if len(rids) > 1 and q is not None and b not in q.table:
                return [ctx.v("I2", f"block {b} is shared by {' and '.join(rids)}, but {rid} computed its own copy "
                                    f"(held blocks are never deduplicated)", [b], rids)]
    return []


@check
def eviction_order(ctx: StepContext) -> list[Violation]:
    if not _valid(ctx):
        return []
    o, pool = ctx.obs, ctx.pool
    # free order "any" (no order stated): the model took the target's own choice of blocks
    # (PoolModel.alloc), so what is left to differ is a choice of blocks that were not free
    follow = pool.order == "any"
    if isinstance(ctx.op, Alloc) and ctx.result != ctx.expected:
        if follow:
            return [ctx.v("EVICTION_ORDER", f"allocation returned blocks {list(ctx.result or ())}, not all of "
                                            f"them free (the free blocks were {sorted(ctx.prev.queue)})")]
        return [ctx.v("EVICTION_ORDER", f"allocation returned blocks {list(ctx.result or ())}; "
                                        f"the policy gives {list(ctx.expected or ())}")]
    if not ctx.comparable:
        return []
    if (sorted(o.queue) != sorted(pool.queue)) if follow else (list(o.queue) != pool.queue):
        return [ctx.v("EVICTION_ORDER", f"the free queue is {list(o.queue)}; the policy gives {pool.queue}")]
    if isinstance(ctx.model, CacheModel):
        for rid, rs in o.requests.items():
            q = ctx.model.reqs.get(rid)
            if q is not None and list(rs.table) != q.table:
                if follow:
                    return [ctx.v("EVICTION_ORDER", f"{rid} got blocks {list(rs.table)}, not all of them free "
                                                    f"(the reference model gives {q.table})", requests=[rid])]
                return [ctx.v("EVICTION_ORDER", f"{rid} got blocks {list(rs.table)}; the policy gives {q.table}",
                              requests=[rid])]
            more = [list(t) for t in getattr(q, "more", ())]
            if q is not None and [list(t) for t in rs.groups] != more:
                return [ctx.v("EVICTION_ORDER", f"{rid} got blocks {[list(t) for t in rs.groups]} in groups 1..; "
                                                f"the policy gives {more}", requests=[rid])]
    return []


@check
def kv_integrity(ctx: StepContext) -> list[Violation]:
    if ctx.shadow is None or not isinstance(ctx.model, CacheModel) or not _valid(ctx):
        return []
    if hasattr(ctx.model, "groups"):
        from kvspec.spec.group_checks import kv_integrity_groups
        return kv_integrity_groups(ctx)
    for rid, rs in ctx.obs.requests.items():
        q = ctx.model.reqs.get(rid)
        if q is None:
            continue
        p = ctx.shadow.first_bad(rs.table, q.tokens, rs.computed)
        if p is not None:
            b = rs.table[p // ctx.config.block_size]
            return [ctx.v("KV_INTEGRITY", f"{rid} reads token {p} from block {b}, which holds KV of another prefix",
                          [b], [rid])]
    return []


from kvspec.spec import group_checks as _group_checks  # noqa: E402  (its checks join CHECKS)

for _fn in (_group_checks.hit_content, _group_checks.hit_agreement, _group_checks.window, _group_checks.slots,
            _group_checks.min_hit):
    check(_fn)


def check_step(ctx: StepContext) -> list[Violation]:
    found: list[Violation] = []
    for fn in CHECKS:
        found.extend(fn(ctx))
    return sorted(found, key=lambda v: PRIORITY.index(v.invariant))


