"""``kvspec mc --workers N``: a level-synchronous parallel breadth-first search.

Each level's frontier is cut into N contiguous slices, in frontier order; N processes
forked from the search (``fork`` start method: each inherits the frontier, the set of
keys seen so far and the key memo, nothing is sent to it) expand one slice each, exactly
as ``kvspec.mc.search`` expands a state: every enabled op is driven and its transition
checked, the key taken, the state checks run where the key is new to what the worker
knows. A worker sends back, in its slice's order, one record per transition that
matters (a finding, a key it had not seen, with the new state pickled), and stops at
its first finding, since nothing after it in its slice can come first.

The search then merges the records slice by slice, in frontier order, which is the
order the one-process search tries the same transitions in: a key is new iff no earlier
record (nor an earlier level) had it, and the first finding in that order is the
one-process search's. So the states per level, the state count and the counterexample
equal the one-process search's (tests/test_mc.py compares them). A worker may run the
state checks on a key that an earlier slice also found (it cannot know): the verdict is
the same (a state check is a function of the key, see ``kvspec.mc.search``), so this
costs time, never changes a result.

States travel between levels pickled: the in-place fork's saved state (slot values
and list copies) with the live objects it restores into sent as references (``registry``:
every worker is a fork of the search, so the same ids name its copies of them), or the
pickle fork's bytes. What crosses a pipe is kept plain, since that is what a second
worker pays for: a state is pickled by ``_RefPickler`` (asked only about the few
objects that are not tuples, ints, bytes ...), its observation goes as tuples
(``flat_obs``; ``obs_of`` builds an equal one on the other side), a key as the bytes it
already is, and a worker hands back only the key-memo entries it added (not the whole
memo). A worker puts a state back into its own copy of the live session
exactly as the one-process search does. A search with another fork (deepcopy, replay: a
target whose state does not pickle) runs in one process (``MCResult.workers`` says so).
"""
from __future__ import annotations

import io
import multiprocessing
from itertools import islice
import pickle
import time
from typing import Any, Callable, Optional

from kvspec.check.session import Session
from kvspec.mc.fork import _DISPATCH, CompactFork, Fork, PickleFork, _is_scalar
from kvspec.spec.observation import BlockState, Observation, RequestState
from kvspec.spec.ops import Op

# What a forked worker reads (set by the search right before it forks the pool).
_LEVEL: dict[str, Any] = {}


def registry(forker: Fork) -> dict[int, Any]:
    """The live objects an in-place fork's saved states point at (the snapshots' graphs
    and every object they restore in place, the live session's model and hash history),
    by ``id``. Every worker is a fork of the search, so the same ids name its copies of
    the same objects: a saved state travels with these as references, never copied."""
    reg = _Registry()
    if isinstance(forker, CompactFork):
        from kvspec.targets.snapshot import _GRAPHS

        live = forker.live
        for g in (forker.graph, _GRAPHS.get(live.driver)):
            if g is not None:
                reg[id(g)] = g
                reg.update((id(o), o) for o in g.objs)
        for k in forker.rest_names:
            v = getattr(live, k)
            if not _is_scalar(v):
                reg[id(v)] = v
    reg.by_reduce = all(type(v) not in _BASIC for v in reg.values())
    return reg


# the types the C pickler writes without asking ``reducer_override`` (CPython's docs)
_BASIC = frozenset({type(None), bool, int, float, bytes, str, dict, set, frozenset, list, tuple})
_LIVE: dict[int, Any] = {}   # the registry a state is being decoded against (see ``_live``)


class _RefPickler(pickle.Pickler):
    """Pickles the live objects of ``reg`` as references (``_live(id)``), modules by name.
    ``reducer_override`` is asked only about objects of other types than ``_BASIC``, so a
    state made mostly of tuples, ints and bytes costs a few calls instead of one per
    object (as ``persistent_id`` does). Used only where no registry object is of a
    ``_BASIC`` type (``_by_reduce``): those would be copied instead of referenced."""

    dispatch_table = _DISPATCH

    def __init__(self, f: Any, reg: dict[int, Any]) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.reg = reg

    def reducer_override(self, o: Any) -> Any:
        if id(o) in self.reg:
            return _live, (id(o),)
        return NotImplemented


def _live(i: int) -> Any:
    return _LIVE[i]


class _Registry(dict):
    """``registry``'s answer: id -> live object, and whether ``_RefPickler`` may send it."""
    by_reduce = False


def _by_reduce(reg: dict[int, Any]) -> bool:
    return getattr(reg, "by_reduce", False)


def encode(forker: Fork, saved: Any, reg: dict[int, Any]) -> Any:
    """A saved state as it travels between processes: the in-place fork's, pickled with
    the live objects as references (``registry``) and modules by name; the pickle fork's
    bytes as they are."""
    if isinstance(forker, CompactFork) and type(saved) is not bytes:
        f = io.BytesIO()
        if _by_reduce(reg):
            _RefPickler(f, reg).dump(saved)
            return "ref", f.getvalue()
        p = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
        p.dispatch_table = _DISPATCH
        p.persistent_id = lambda o: id(o) if id(o) in reg else None
        p.dump(saved)
        return "compact", f.getvalue()
    return saved


def decode(sent: Any, reg: dict[int, Any]) -> Any:
    if type(sent) is tuple and sent[0] == "ref":
        global _LIVE
        _LIVE = reg
        return pickle.loads(sent[1])
    if type(sent) is tuple and sent[0] == "compact":
        u = pickle.Unpickler(io.BytesIO(sent[1]))
        u.persistent_load = reg.__getitem__
        return u.load()
    return sent


def flat_obs(obs: Any) -> Any:
    """An observation as plain tuples for the trip between processes (pickling the frozen
    dataclasses costs more than the rest of a state); ``obs_of`` builds an equal one.
    Anything but the plain classes travels as it is."""
    if type(obs) is not Observation or any(type(b) is not BlockState for b in obs.blocks) \
            or any(type(r) is not RequestState for r in obs.requests.values()):
        return obs
    return ("flat", tuple([(b.ref, b.hash, b.queued) for b in obs.blocks]), obs.queue, tuple(obs.index.items()),
            obs.free_count, obs.null_block, tuple([(k, r.table, r.computed, r.groups) for k, r in obs.requests.items()]),
            obs.queue_problems)


def obs_of(sent: Any) -> Any:
    if type(sent) is not tuple or sent[0] != "flat":
        return sent
    _, blocks, queue, index, free, null, reqs, problems = sent
    return Observation(blocks=tuple([BlockState(*b) for b in blocks]), queue=queue, index=dict(index),
                       free_count=free, null_block=null,
                       requests={k: RequestState(t, c, g) for k, t, c, g in reqs}, queue_problems=problems)


def _expand(slice_no: int) -> dict:
    """One worker: expand its slice of the frontier; records in the slice's order."""
    L = _LEVEL
    frontier, lo, hi = L["frontier"], L["bounds"][slice_no], L["bounds"][slice_no + 1]
    seen, unchecked, key_of, ops_of = L["seen"], L["unchecked"], L["key_of"], L["ops_of"]
    checker, invariant, last, next_extra = L["checker"], L["invariant"], L["last"], L["next_extra"]
    fk: Fork = L["forker"]
    reg = L["registry"]
    local: set = set()
    out: list[tuple] = []          # (frontier position, op index, op, kind, payload)
    ops_per: list[int] = []        # ops tried per frontier position (to count transitions)
    memo = getattr(key_of, "memo", None) if L["in_child"] else None   # a KeyMemo: keys per exact state
    n0 = len(memo) if memo is not None else 0

    def done(timeout: bool) -> dict:
        # the keys this worker computed go back too, so later levels look them up (KeyMemo)
        learned = list(islice(memo.items(), n0, None)) if memo is not None and len(memo) >= n0 else []
        return {"records": out, "ops": ops_per, "timeout": timeout, "memo": learned}

    def record(found: list, pos: int, i: int, op) -> bool:
        """Note a failing transition; True when it ends the search (only ``invariant`` does,
        with one given: another failure is a dead end, as in the one-process search)."""
        hit = invariant is None or found[0].invariant == invariant
        out.append((pos, i, op, "found" if hit else "pruned", found if hit else None))
        if hit:
            ops_per[-1] = i + 1
        return hit

    for pos in range(lo, hi):
        if time.monotonic() > L["deadline"]:
            return done(True)
        sent, obs, extra, _ = frontier[pos]
        saved, obs = decode(sent, reg), obs_of(obs)
        base = fk.load(saved, obs)
        ops = ops_of(base, extra)
        ops_per.append(len(ops))
        for i, op in enumerate(ops):
            t = base if i == 0 else fk.load(saved, obs)
            if checker is not None:
                checker.reset()
            found = t.apply(op)
            if found and checker is not None:
                found = checker.state_violations() or found   # a failing step: every check, as check_step
            if found:
                if record(found, pos, i, op):
                    return done(False)
                continue
            ex2 = next_extra(extra, op)
            k = key_of(t, ex2)
            new = k not in seen and k not in local
            status = "checked"
            if checker is not None and (new or k in unchecked):
                if checker.last_comparable:
                    found = checker.state_violations()
                    if found:
                        if record(found, pos, i, op):
                            return done(False)
                        continue
                else:
                    status = "unchecked"
            if not new:
                if k in unchecked and status == "checked":
                    out.append((pos, i, op, "rechecked", k))
                continue
            local.add(k)
            state = None if last else (encode(fk, fk.save(t, lambda: []), reg), flat_obs(t.obs))
            out.append((pos, i, op, "new", (k, status, state, ex2)))
    return done(False)


def run_level(workers: int, frontier: list, seen: set, unchecked: set, key_of: Callable, ops_of: Callable,
              checker: Any, invariant: Optional[str], last: bool, next_extra: Callable, forker: Fork,
              reg: dict, deadline: float) -> list[dict]:
    """Expand one level over ``workers`` forked processes; their results in slice order."""
    n = len(frontier)
    k = max(1, min(workers, n))
    bounds = [n * j // k for j in range(k + 1)]
    _LEVEL.update(frontier=frontier, bounds=bounds, seen=seen, unchecked=unchecked, key_of=key_of,
                  ops_of=ops_of, checker=checker, invariant=invariant, last=last, next_extra=next_extra,
                  forker=forker, registry=reg, deadline=deadline)
    try:
        if k == 1:
            _LEVEL["in_child"] = False
            return [_expand(0)]
        _LEVEL["in_child"] = True
        with multiprocessing.get_context("fork").Pool(k) as pool:
            results = pool.map(_expand, range(k), chunksize=1)
        memo = getattr(key_of, "memo", None)
        if memo is not None:
            for r in results:
                if len(memo) + len(r["memo"]) > key_of.limit:
                    memo.clear()
                memo.update(r["memo"])
        return results
    finally:
        _LEVEL.clear()


def can_send(forker: Fork, s0: Session) -> bool:
    """Can this search's saved states travel between processes (pickled, and put back
    faithfully)? Only the in-place and the pickle forks are sent; the others search in
    one process."""
    if not isinstance(forker, (CompactFork, PickleFork)):
        return False
    obs = s0.obs
    try:
        reg = registry(forker)
        saved = forker.save(s0, lambda: [])
        back = decode(pickle.loads(pickle.dumps(encode(forker, saved, reg))), reg)
        return forker.load(back, obs).driver.observe() == obs
    except Exception:
        return False


def path_of(parents: list[tuple[int, Optional[Op]]], i: int) -> list[Op]:
    out = []
    while i > 0:
        i, op = parents[i]
        out.append(op)
    return out[::-1]


def parallel_search(res: Any, workers: int, depth: int, forker: Fork, s0: Session, extra0: dict, seen: set,
                    key_of: Callable,
                    ops_of: Callable, checker: Any, invariant: Optional[str], next_extra: Callable,
                    parents: list, deadline: float, max_states: Optional[int]) -> str:
    """The level loop of ``kvspec.mc.search.model_check`` over ``workers`` processes;
    fills ``res`` in and returns the verdict."""
    unchecked: set = set()
    reg = registry(forker)
    frontier: list = [(encode(forker, forker.save(s0, lambda: []), reg), s0.obs, extra0, 0)]
    for d in range(1, depth + 1):
        last = d == depth
        results = run_level(workers, frontier, seen, unchecked, key_of, ops_of, checker, invariant, last,
                            next_extra, forker, reg, deadline)
        nxt: list = []
        for r in results:     # slice by slice, in frontier order: the one-process order
            res.transitions += sum(r["ops"])
            for pos, i, op, kind, payload in r["records"]:
                idx = frontier[pos][3]
                if kind == "found":
                    res.counterexample, res.violations, res.depth = path_of(parents, idx) + [op], payload, d
                    return "violation"
                if kind == "pruned":
                    res.pruned += 1
                    continue
                if kind == "rechecked":
                    unchecked.discard(payload)
                    continue
                k, status, state, ex2 = payload
                if k in seen:
                    if status == "checked":
                        unchecked.discard(k)
                    continue
                seen.add(k)
                if status == "unchecked":
                    unchecked.add(k)
                parents.append((idx, op))
                res.states += 1
                nxt.append(None if last else (state[0], state[1], ex2, len(parents) - 1))
                if max_states is not None and res.states > max_states:
                    res.reason = f"state cap of {max_states} reached at depth {d}"
                    return "incomplete"
            if r["timeout"]:
                res.reason = f"time cap reached at depth {d}"
                return "incomplete"
        res.levels.append(len(nxt))
        res.depth = d
        frontier = nxt
        if not nxt:
            res.exhausted = True
            break
    return "pass"
