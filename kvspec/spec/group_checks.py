"""The checks of KV-cache groups, windows and slots (HIT_AGREEMENT, WINDOW, SLOTS) and
the group-aware KV_INTEGRITY read, registered into ``kvspec.spec.invariants.CHECKS``.

They read the per-group tables of ``RequestState`` (``table`` for group 0, ``groups``
for the others) and the ``GroupCacheModel``; with any other model they find nothing.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from kvspec.spec.model.groups import cdiv, lost_identity
from kvspec.spec.model.hybrid import GroupCacheModel
from kvspec.spec.ops import Admit, Prefill, Step
from kvspec.spec.violation import Violation


def tables(rs) -> tuple:
    return (tuple(rs.table),) + tuple(getattr(rs, "groups", ()) or ())


def _model(ctx) -> Optional[GroupCacheModel]:
    m = ctx.model
    return m if isinstance(m, GroupCacheModel) else None


def hit_agreement(ctx) -> list[Violation]:
    """After an admission whose hit length matches the model's, every group takes from
    the cache exactly the blocks of that hit: no group keeps a longer hit (a cached
    block of its own past the agreed length) and none a shorter one."""
    m = _model(ctx)
    if m is None or not isinstance(ctx.op, Admit) or not ctx.comparable or not isinstance(ctx.result, int):
        return []
    rid, hit = ctx.op.req, ctx.result
    rs, q = ctx.obs.requests.get(rid), m.reqs.get(rid)
    if rs is None or q is None:
        return []
    k = hit // m.bs
    for g, (got, want) in enumerate(zip(tables(rs), q.tables())):
        for i in range(min(len(got), len(want))):
            if got[i] == want[i]:
                continue
            b = got[i]
            was = ctx.prev.blocks[b] if 0 <= b < len(ctx.prev.blocks) else None
            key = None if was is None or was.hash is None or ctx.hashes is None else ctx.hashes.key_of(was.hash)
            if i >= k and key is not None and key == m.gkey(q, g, i):
                return [ctx.v("HIT_AGREEMENT", f"{rid}: group {g} ({m.groups[g]}) took cached block {b} for its "
                                               f"block {i}, past the {hit} tokens all groups agreed on", [b], [rid])]
            if i < k and b != m.null:  # a null entry where the cache gives a block is WINDOW's
                return [ctx.v("HIT_AGREEMENT", f"{rid}: group {g} ({m.groups[g]}) holds block {b} at block {i}, "
                                               f"inside the agreed {hit}-token hit, where the cache gives {want[i]}",
                              [b], [rid])]
    return []


def min_hit(ctx) -> list[Violation]:
    """A lower bound on hits: an admission takes at least the hit the model proves every
    group can serve (``GroupCacheModel.hit_floor``, stated under EAGLE/MTP only, where
    it is ``spec.model.groups.eagle_hit``). MAX_HIT bounds a hit from above; without this
    a manager that loses valid hits (H10 of reports/vllm-history.md: EAGLE's drop applied
    again on each retry pass of the hybrid coordinator) breaks nothing stated."""
    m = _model(ctx)
    if m is None or not isinstance(ctx.op, Admit) or ctx.misuse is not None or ctx.error is not None:
        return []
    floor, got = m.hit_floor, ctx.result
    if floor is None or not isinstance(got, int) or isinstance(got, bool) or got >= floor:
        return []
    rid = ctx.op.req
    return [ctx.v("MIN_HIT", f"{rid} hit {got} tokens, but every group can serve {floor} (EAGLE: each group has "
                             f"those blocks cached and the one after them, which it matches and drops once)",
                  requests=[rid])]


def _scheduled(ctx) -> Optional[str]:
    """The request whose tokens this step computed (None if refused or none)."""
    if not isinstance(ctx.op, (Admit, Prefill, Step)) or ctx.result is None or ctx.result is False:
        return None
    # where the step's tokens start is the model's account: only when it decided alike
    return ctx.op.req if ctx.comparable else None


def read_from(m: GroupCacheModel, grp, rid: str, rs, scheduled: Optional[str]) -> int:
    """The first position any query of this step, or the next one, reads in group ``grp``:
    the step's own queries start at the first token it computed."""
    q = m.reqs.get(rid)
    c = rs.computed
    if rid == scheduled and q is not None:
        c = min(c, q.computing_from)
    return grp.attends_from(c)


def hit_content(ctx) -> list[Violation]:
    """HASH_CHAIN for a hit: every block an admission takes from the cache holds this
    request's content, extra keys included (equal tokens under other extra keys do not
    count). Read from the target's own hashes, so it holds whatever the model decided."""
    m = _model(ctx)
    if m is None or ctx.hashes is None or not isinstance(ctx.op, Admit) or not isinstance(ctx.result, int) \
            or ctx.misuse is not None or ctx.error is not None:
        return []
    rid = ctx.op.req
    rs, q = ctx.obs.requests.get(rid), m.reqs.get(rid)
    if rs is None or q is None:
        return []
    for g, t in enumerate(tables(rs)):
        for i, b in enumerate(t[: ctx.result // m.bs]):
            if b == ctx.obs.null_block or not 0 <= b < len(ctx.obs.blocks):
                continue
            # the hash it was hit by: the one it had before this step
            h = ctx.prev.blocks[b].hash if b < len(ctx.prev.blocks) else None
            have = None if h is None else ctx.hashes.key_of(h)
            want = m.gkey(q, g, i)
            if have is not None and have != want:
                from kvspec.spec.shadow import _show
                v = ctx.v("HASH_CHAIN", f"{rid} hit block {b} as its block {i} (group {g}), but that block's hash "
                                        f"stands for {_show(have)}; {rid} needs {_show(want)}", [b], [rid])
                return [replace(v, where=lost_identity(have, want))]   # the same bug as the collision behind it
    return []


def window(ctx) -> list[Violation]:
    """Every block a still-needed query reads is held; a block the windows left behind
    is the null block in the table (freed), never still held."""
    m = _model(ctx)
    if m is None or not (ctx.misuse is None and ctx.error is None):
        return []
    null = ctx.obs.null_block
    bs = m.bs
    scheduled = _scheduled(ctx)
    for rid, rs in ctx.obs.requests.items():
        q = m.reqs.get(rid)
        for g, (grp, t) in enumerate(zip(m.groups, tables(rs))):
            c = min(rs.computed, len(t) * bs)
            for p in range(read_from(m, grp, rid, rs, scheduled), c):
                if t[p // bs] == null:
                    return [ctx.v("WINDOW", f"{rid}: group {g} ({grp}) freed block {p // bs} of its table, but a "
                                            f"query still reads position {p}", requests=[rid])]
            if q is not None and ctx.comparable:
                want = q.tables()[g] if g < len(q.tables()) else []
                for i, (b, w) in enumerate(zip(t, want)):
                    if w == m.null and b != null:
                        return [ctx.v("WINDOW", f"{rid}: group {g} ({grp}) still holds block {b} at block {i}, "
                                                f"which the window has left behind (no query reads it)", [b], [rid])]
    return []


def slots(ctx) -> list[Violation]:
    """Every computed or scheduled token (draft tokens too) has a slot in every group,
    a scheduled one a real block, and no table passes the max_model_len cap."""
    m = _model(ctx)
    if m is None or not (ctx.misuse is None and ctx.error is None):
        return []
    bs, null = m.bs, ctx.obs.null_block
    cap = None if m.max_len is None else cdiv(m.max_len, bs)
    scheduled = _scheduled(ctx)
    for rid, rs in ctx.obs.requests.items():
        q = m.reqs.get(rid)
        start = q.computing_from if q is not None else rs.computed   # hit and connector tokens are not computed
        if m.max_len is not None and rs.computed > m.max_len:
            return [ctx.v("SLOTS", f"{rid} has {rs.computed} tokens computed or scheduled, past max_model_len "
                                   f"{m.max_len}", requests=[rid])]
        for g, t in enumerate(tables(rs)):
            if cap is not None and len(t) > cap:
                return [ctx.v("SLOTS", f"{rid}: group {g} holds {len(t)} blocks, past the cap of {cap} "
                                       f"(max_model_len {m.max_len}, block size {bs})", requests=[rid])]
            if len(t) * bs < rs.computed:
                return [ctx.v("SLOTS", f"{rid}: group {g} has slots for {len(t) * bs} tokens but {rs.computed} "
                                       f"are computed or scheduled", requests=[rid])]
            if rid == scheduled:
                for p in range(start, rs.computed):
                    if t[p // bs] == null:
                        return [ctx.v("SLOTS", f"{rid}: group {g} writes scheduled token {p} to the null block",
                                      requests=[rid])]
    return []


def kv_identity(m: GroupCacheModel, q, g: int, p: int):
    if p < len(q.tokens):
        return m.kv_identity(q, g, p)
    tokens = list(q.tokens) + list(q.drafts)
    return (g, q.extra.upto(p + 1), tuple(tokens[: p + 1]))


def write_shadow(shadow, m: GroupCacheModel, op, result, requests, before_requests, null) -> None:
    """Write the KV the target just computed through the slot mapping of its own tables:
    for the tokens each request scheduled, in every group, skipping positions behind
    the window (their block is null: nothing is written there)."""
    bs = m.bs
    for rid, rs in requests.items():
        q = m.reqs.get(rid)
        if q is None:
            continue
        before = before_requests.get(rid)
        if isinstance(op, Admit) and op.req == rid and isinstance(result, int):
            start = result
        elif before is not None:
            start = before.computed
        else:
            start = rs.computed
        for g, t in enumerate(tables(rs)):
            for p in range(start, min(rs.computed, len(t) * bs)):
                b = t[p // bs]
                if b != null:
                    shadow.slots[(b, p % bs)] = kv_identity(m, q, g, p)


def kv_integrity_groups(ctx) -> list[Violation]:
    """Every position a query reads, in every group and within its window, holds KV
    computed for this request's prefix (group, extra keys and tokens)."""
    m = ctx.model
    bs, null = m.bs, ctx.obs.null_block
    scheduled = _scheduled(ctx)
    for rid, rs in ctx.obs.requests.items():
        q = m.reqs.get(rid)
        if q is None:
            continue
        for g, (grp, t) in enumerate(zip(m.groups, tables(rs))):
            c = min(rs.computed, len(t) * bs)
            for p in range(read_from(m, grp, rid, rs, scheduled), c):
                b = t[p // bs]
                if b == null:
                    continue  # WINDOW reports a needed block that was freed
                if ctx.shadow.slots.get((b, p % bs)) != kv_identity(m, q, g, p):
                    return [ctx.v("KV_INTEGRITY", f"{rid} reads token {p} of group {g} ({grp}) from block {b}, "
                                                  f"which holds KV of another prefix", [b], [rid])]
    return []


# -- helpers of the older checks (kvspec.spec.invariants) ------------------------------
def tables_differ(ctx) -> bool:
    """The request this step scheduled got other blocks than the model's: its blocks'
    hashes describe other contents on the two sides, so pairing them would only repeat
    that divergence (EVICTION_ORDER and the hit checks own it)."""
    rid = getattr(ctx.op, "req", None)
    if rid is None or not hasattr(ctx.model, "reqs"):
        return False
    rs, q = ctx.obs.requests.get(rid), ctx.model.reqs.get(rid)
    if rs is None or q is None:
        return False
    return list(rs.table) != list(q.table) or [list(t) for t in rs.groups] != [list(t) for t in getattr(q, "more", ())]


def window_reused(ctx, b: int, old_hash) -> bool:
    """A window group may free a block and the same step allocate it again (a new
    holder, a new hash): fine where the model did that too."""
    if not hasattr(ctx.model, "groups") or ctx.hashes is None or not ctx.comparable:
        return False
    return b < len(ctx.pool.hash) and ctx.pool.hash[b] != ctx.hashes.key_of(old_hash)
