"""What the scheduler tells its KV manager, checked after every engine event.

The cache-level catalogue runs on every manager call (``kvspec.engine.session``); these
checks read the engine's own decisions (``StepFacts``) against what the manager holds
once the event is processed:

- SLOTS: every token scheduled this step has a slot in its request's table (no two
  scheduled tokens share one), the scheduler asked the manager for room for every one
  of them (where the engine reports its manager calls), and every request's computed
  tokens fit in its blocks; with a drafter's lookahead (``StepFacts.lookahead``), every
  scheduled request's table also covers that many slots past its scheduled tokens;
- NO_LEAK: a request preempted, finished or aborted in this event holds no block, and one
  the scheduler preempts to make room (inside ``schedule()``) gives its blocks back to the
  pool there: a preemption whose free is deferred behind a step in flight (vLLM's async
  scheduling with a consumer connector, #45357's fence) reclaims nothing, so the allocation
  it was made for is no nearer (vLLM #49674: cascades of zero-progress preemptions). A
  request whose connector load is still in flight (``EngineDriver.loading``, optional)
  keeps the blocks the load writes until the load reports, even once aborted;
- KV_INTEGRITY: such a request's blocks never go back to the pool before its load reports
  (the load would write into whichever request gets them next: vLLM #32255);
- PRIORITY: under the priority policy, a request still running after the step's
  preemptions never comes after one that was preempted in (priority, arrival) order;
- COMMON_PREFIX: the common-prefix block count the scheduler reports (cascade attention's)
  counts blocks every request in the step's batch holds, at the same places;
- ACCOUNTING (``check_reset``): ``reset_prefix_cache`` succeeds exactly when no block is held.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

from kvspec.engine.protocol import EngineDriver, StepFacts
from kvspec.spec.ops import Abort, Op
from kvspec.spec.violation import Violation


def check_event(op: Op, facts: Optional[StepFacts], driver: EngineDriver,
                allocated: Optional[dict[str, int]] = None, before: Optional[dict[str, int]] = None,
                shared_slots: bool = False) -> list[Violation]:
    """``allocated``: request -> tokens the manager's successful allocations this event
    made room for (None: the engine does not report its manager calls). ``before``:
    request -> tokens it held room for when the step was scheduled (its computed tokens
    before the event, or the prefix-cache hit of an admission in this event): scheduled
    positions below it already had room (a declared whole-prompt hit recomputes its
    cached last token in place, in a slot its admission holds).
    ``shared_slots``: two requests may write one slot in a step (whole-prompt hits on the
    same cached block write the same KV)."""
    obs = driver.observe()
    tables = driver.tables()
    bs = driver.block_size

    def v(inv: str, msg: str, rid: str, blocks=()) -> Violation:
        return Violation(inv, f"{op!r}: {msg}", obs.excerpt(list(blocks), [rid]))

    out: list[Violation] = []
    released = []
    if facts is not None:
        released += [(r, "preempted") for r in facts.preempted] + [(r, "finished") for r in facts.finished]
    if isinstance(op, Abort):
        released.append((op.req, "aborted"))
    if facts is not None:
        for rid in facts.unreclaimed:
            out.append(v("NO_LEAK", f"{rid} was preempted to make room but none of its blocks returned to the pool "
                                    f"(its free is deferred behind a step in flight): a preemption that reclaims "
                                    f"nothing costs {rid} its progress and leaves the allocation it was made for "
                                    f"short", rid))
    loading = getattr(driver, "loading", None)
    in_flight = loading() if callable(loading) else set()
    for rid, how in released:
        held = tables.get(rid, ())
        if rid in in_flight:   # a connector's load still writes its blocks: they return when it reports
            if not held:
                out.append(v("KV_INTEGRITY", f"{rid} was {how} while its connector load was in flight, and its blocks "
                                             f"went back to the pool: the load still writes them, over whatever "
                                             f"request they go to next", rid))
            continue
        if held:
            out.append(v("NO_LEAK", f"{rid} was {how} but still holds blocks {list(held)}", rid, held))
    if facts is not None:
        for rid, n in facts.scheduled.items():
            got = facts.slots.get(rid, ())
            if len(got) < n:
                start = facts.start.get(rid, 0)
                out.append(v("SLOTS", f"{rid} was scheduled {n} tokens from position {start}, but only "
                                      f"{len(got)} of them have a slot in its table", rid))
            had_room = max(0, min(n, (before or {}).get(rid, 0) - facts.start.get(rid, 0)))
            if allocated is not None and allocated.get(rid, 0) < n - had_room:
                out.append(v("SLOTS", f"{rid} was scheduled {n} tokens, but the scheduler asked the KV manager "
                                      f"for room for only {allocated.get(rid, 0)}", rid))
        for rid, n in facts.scheduled.items():
            need = facts.start.get(rid, 0) + n + facts.lookahead
            need = min(need, facts.cap) if facts.cap else need
            if facts.lookahead and rid in facts.covered and facts.covered[rid] < need:
                out.append(v("SLOTS", f"{rid} was scheduled {n} tokens from position {facts.start.get(rid, 0)} with "
                                      f"{facts.lookahead} lookahead slots for the drafter, but its table has room "
                                      f"for {facts.covered[rid]} positions, not {need}", rid))
        out += _priority(facts, v)
        out += _common_prefix(facts, v)
        dup = [] if shared_slots else \
            [s for s, c in Counter(s for got in facts.slots.values() for s in got).items() if c > 1]
        if dup:
            owners = sorted(r for r, got in facts.slots.items() if dup[0] in got)
            out.append(v("SLOTS", f"slot {dup[0]} (block {dup[0] // bs}) is written by "
                                  f"{' and '.join(owners) or 'one request twice'} in the same step", owners[0] if owners else "",
                         [dup[0] // bs]))
    for rid, c in driver.computed().items():
        have = len(tables.get(rid, ())) * bs
        if c > have:
            out.append(v("SLOTS", f"{rid} has {c} computed tokens but its blocks hold only {have}", rid))
    return out


def _priority(facts: StepFacts, v) -> list[Violation]:
    """PRIORITY: each preempted request was last in (priority, arrival) order among the
    requests running at the step's start that it left running."""
    if not facts.rank or not facts.preempted:
        return []
    kept = [r for r in facts.rank if r not in facts.preempted]
    for p in facts.preempted:
        if p not in facts.rank:
            continue
        later = [r for r in kept if facts.rank[r] > facts.rank[p]]
        if later:
            r = max(later, key=lambda x: facts.rank[x])
            return [v("PRIORITY", f"{p} (priority {facts.rank[p][0]}) was preempted while {r} (priority "
                                  f"{facts.rank[r][0]}, {'later arrival' if facts.rank[r][0] == facts.rank[p][0] else 'lower priority'}) "
                                  f"kept running: the priority policy preempts the lowest-priority request first", p)]
    return []


def _common_prefix(facts: StepFacts, v) -> list[Violation]:
    """COMMON_PREFIX: the common-prefix count the scheduler reports for a group is a number of
    leading blocks that every request scheduled in the step holds, the same ids in the same
    places. Cascade attention reads that prefix once, from one request's table, for the whole
    batch: a request that does not hold it attends to another request's KV (vLLM #23130,
    #55227: reference counts held by requests outside the batch make a block look shared)."""
    for g, n in enumerate(facts.common_prefix):
        if n <= 0 or not facts.group_tables:
            continue
        tables = {rid: t[g] if g < len(t) else () for rid, t in facts.group_tables.items()}
        ref_rid = max(tables, key=lambda r: len(tables[r]))
        ref = tables[ref_rid][:n]
        for rid, t in sorted(tables.items()):
            if t[:n] != ref or len(t) < n:
                where = "group 0" if len(facts.common_prefix) == 1 else f"group {g}"
                return [v("COMMON_PREFIX", f"the scheduler reports {n} common-prefix blocks ({where}) for a batch in "
                                           f"which {rid} holds {list(t[:n])} there and {ref_rid} holds {list(ref)}: "
                                           f"cascade attention would read one table's prefix for both", rid,
                          sorted(set(t[:n]) ^ set(ref)))]
    return []


def check_reset(op: Op, ok: Optional[bool], driver: EngineDriver) -> list[Violation]:
    """ACCOUNTING for an engine's ``reset_prefix_cache``: it returned True exactly when no
    block was held. A refused reset changes nothing, so the state after it is the state
    it was refused in; a successful one left every block free."""
    if ok is None:
        return []
    obs = driver.observe()
    held = [b for b in obs.usable_ids() if obs.blocks[b].ref > 0]
    if ok and held:
        return [Violation("ACCOUNTING", f"{op!r}: reset_prefix_cache returned True but blocks {held} are held",
                          obs.excerpt(held, []))]
    if not ok and not held:
        return [Violation("ACCOUNTING", f"{op!r}: reset_prefix_cache returned False although no block is held",
                          obs.excerpt([], []))]
    return []
