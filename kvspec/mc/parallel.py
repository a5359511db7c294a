"""``kvspec mc --workers N``: a level-synchronous parallel breadth-first search.

Each level's frontier is cut into chunks of contiguous states, in frontier order.
N - 1 worker processes are forked from the search for the level (``fork`` start
method: each inherits the frontier, the set of keys seen so far and the key memo,
nothing is sent to it), and they and the search itself claim chunks from one shared
counter until none is left, so that a process that got slow chunks does not hold the
level up. A chunk's states are expanded by the one-process search's own loop
(``kvspec.mc.expand``): every enabled op is driven and its transition checked, the key
taken, the state checks run where the key is new to what the process knows. A chunk's
result holds, in frontier order, one record per transition that matters (a finding, a
key the process had not seen, with the new state), and a process stops at its first
finding, claiming nothing more: no chunk after that one can come first. A level of
fewer than ``MIN_SLICE`` states per process is expanded by the search alone.

The search then merges the records chunk by chunk, in frontier order, which is the
order the one-process search tries the same transitions in: a key is new iff no earlier
record (nor an earlier level) had it, and the first finding in that order is the
one-process search's. So the states per level, the state count and the counterexample
equal the one-process search's (tests/test_mc.py compares them). A process may run the
state checks on a key that another chunk also found (it cannot know): the verdict is
the same (a state check is a function of the key, see ``kvspec.mc.search``), so this
costs time, never changes a result.

States a worker finds travel back packed (``kvspec.mc.pack``: the in-place fork's saved
state pickled with the live objects it restores into as references; every worker is a
fork of the search, so the same ids name its copies of them). What crosses a pipe is
kept plain, since that is what a second worker pays for: its observation goes as tuples
(``flat_obs``; ``obs_of`` builds an equal one on the other side), a key as the bytes it
already is. States the search finds itself stay as they are (the next level's workers
inherit them). A worker's key memo is not sent back (see ``_share``). A worker puts a
state back into its own copy of the live session exactly as the one-process search
does. A search with another fork (deepcopy, replay: a target whose state does not
pickle) runs in one process (``MCResult.workers`` says so).
"""
from __future__ import annotations

import multiprocessing
from typing import Any, Callable, Optional

from kvspec.check.session import Session
from kvspec.mc.budget import CapReached
from kvspec.mc.expand import FOUND, NEW, PRUNED, RECHECKED, Expander
from kvspec.mc.fork import Fork
from kvspec.mc.pack import decode, encode, registry
from kvspec.spec.observation import BlockState, Observation, RequestState
from kvspec.spec.ops import Op

# What the search and its forked workers read for a level (set right before the workers are forked).
_LEVEL: dict[str, Any] = {}
MIN_SLICE = 32            # frontier states per process, at least, before a level is split
MIN_CHUNK = 8             # frontier states per chunk, at least
CHUNKS_PER_PROCESS = 32    # chunks per process: enough to even out their speeds, few enough to cost nothing


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


def _share() -> dict:
    """This process's share of a level: chunks of the frontier claimed one at a time from
    the shared counter until none is left (so a slow chunk does not hold the other
    processes up), each expanded by ``_expand``. No chunk past one with a finding is
    claimed: the merge stops there. Returns the chunks' results by number.

    A forked worker's key memo (``KeyMemo``) dies with it: sending its new entries back
    cost more than the search saved by them (pool, 5 blocks, whole space: 3.74 s wall
    with them, 3.47 s without; the search's own memo learns its chunks in place)."""
    L = _LEVEL
    counter, stop, bounds = L["counter"], L["stop"], L["bounds"]
    done: dict[int, dict] = {}
    local: set = set()   # keys this process found new this level (the search merges them later)
    while True:
        with counter.get_lock():
            c = counter.value
            counter.value = c + 1
        if c >= len(bounds) - 1 or c > stop.value:
            break
        r = done[c] = _expand(bounds[c], bounds[c + 1], local)
        if r["found"]:
            with stop.get_lock():
                stop.value = min(stop.value, c)
        if r["timeout"]:
            # The level ends incomplete, so none of its states is expanded: only their
            # keys and counts go back. Their saved states can be gigabytes at a large
            # level, and sending them once made a capped search run minutes past its cap.
            for d in done.values():
                d["records"] = [(pos, i, op, kind, (pl[0], pl[1], None, pl[3]) if kind == NEW else pl)
                                for pos, i, op, kind, pl in d["records"]]
        if r["found"] or r["timeout"]:
            break
    return {"chunks": done}


def _expand(lo: int, hi: int, local: set) -> dict:
    """Expand frontier positions lo..hi-1 (``kvspec.mc.expand``, as the one-process search
    does); records in frontier order."""
    L = _LEVEL
    frontier, seen, unchecked, last = L["frontier"], L["seen"], L["unchecked"], L["last"]
    ex: Expander = L["expander"]
    fk: Fork = ex.forker
    reg = L["registry"]
    out: list[tuple] = []          # (frontier position, op index, op, kind, payload)
    t0, c0 = ex.transitions, ex.state_checks

    def done(timeout: bool, found: bool = False, reason: str = "") -> dict:
        return {"records": out, "transitions": ex.transitions - t0, "state_checks": ex.state_checks - c0,
                "timeout": timeout, "found": found, "reason": reason}

    try:
        for pos in range(lo, hi):
            _expand_one(pos, frontier, seen, unchecked, local, last, ex, fk, reg, out)
            if out and out[-1][3] == FOUND:   # no transition after it can come first
                return done(False, True)
    except CapReached as e:   # (the expander checks the caps before each transition)
        return done(True, reason=e.reason)
    return done(False)


def _expand_one(pos: int, frontier: list, seen: set, unchecked: set, local: set, last: bool, ex: Expander,
                fk: Fork, reg: dict, out: list) -> None:
    """One frontier state's records, appended to ``out`` (stops at a finding)."""
    L = _LEVEL
    sent, obs, extra, _ = frontier[pos]
    for i, op, kind, payload in ex.expand(decode(sent, reg), obs_of(obs), extra, seen, unchecked, local):
        if kind == FOUND or kind == PRUNED or kind == RECHECKED:
            # (a pruned transition's violations are not needed by the merge: not sent)
            out.append((pos, i, op, kind, None if kind == PRUNED else payload))
            if kind == FOUND:   # no transition after it can come first
                return
            continue
        k, checked, t, ex2 = payload
        local.add(k)
        if last:
            state = None
        elif L["in_child"]:   # travels back to the search
            state = (encode(fk, fk.save(t, lambda: []), reg), flat_obs(t.obs))
        else:   # stays in the search's process, and the next level's workers inherit it
            state = (fk.save(t, lambda: []), t.obs)
        out.append((pos, i, op, NEW, (k, checked, state, ex2)))


def run_level(workers: int, frontier: list, seen: set, unchecked: set, expander: Expander, last: bool,
              reg: dict) -> tuple[list[dict], int]:
    """Expand one level over up to ``workers`` processes: the chunks' results in
    frontier order, and how many processes took part."""
    n = len(frontier)
    # A small level is expanded here: forking would cost more than it saves.
    k = max(1, min(workers, n // MIN_SLICE))
    chunks = 1 if k == 1 else min(n // MIN_CHUNK, CHUNKS_PER_PROCESS * k)
    bounds = [n * j // chunks for j in range(chunks + 1)]
    ctx = multiprocessing.get_context("fork")
    _LEVEL.update(frontier=frontier, bounds=bounds, seen=seen, unchecked=unchecked, expander=expander,
                  last=last, registry=reg, in_child=False,
                  counter=ctx.Value("l", 0), stop=ctx.Value("l", chunks))
    try:
        if k == 1:
            shares = [_share()]
        else:
            # k - 1 forked workers (forked now, so they see this level as it is) and the
            # search itself, in its own warm process, claim chunks from one counter. Plain
            # processes and pipes, not a Pool: a Pool's three handler threads would share
            # the search's interpreter while it expands its own chunks.
            procs = []
            for _ in range(k - 1):
                recv, send = ctx.Pipe(duplex=False)
                # the worker closes its copies of every read end: if the search dies, its
                # send then fails at once instead of blocking forever on a full pipe
                p = ctx.Process(target=_worker, args=(send, [r for _, r in procs] + [recv]), daemon=True)
                p.start()
                send.close()
                procs.append((p, recv))
            shares = [_share()]
            for p, recv in procs:
                try:
                    status, payload = recv.recv()
                except EOFError:
                    payload, status = f"it exited with code {p.exitcode}", "died"
                finally:
                    recv.close()
                    p.join()
                if status != "ok":
                    raise RuntimeError(f"kvspec mc: a worker process failed: {payload}")
                shares.append(payload)
        by_chunk = {c: r for sh in shares for c, r in sh["chunks"].items()}
        # in chunk order, the one-process order; a chunk nobody claimed lies past a
        # finding (the merge stops before it) or a timeout, and reads as one
        missing = {"records": [], "transitions": 0, "state_checks": 0, "timeout": True, "found": False, "reason": ""}
        return [by_chunk.get(c, missing) for c in range(chunks)], k
    finally:
        _LEVEL.clear()


def _worker(send: Any, read_ends: list) -> None:
    """A forked worker: its share of the level, sent back whole (the states it finds
    travel pickled, see ``_expand``)."""
    for r in read_ends:   # (inherited by the fork; only the search reads them)
        r.close()
    _LEVEL["in_child"] = True
    try:
        out: tuple = ("ok", _share())
    except BaseException as e:   # said in the search's process, which raises it
        out = ("error", f"{type(e).__name__}: {e}")
    send.send(out)
    send.close()


def parallel_search(res: Any, workers: int, depth: int, forker: Fork, s0: Session, extra0: dict, seen: set,
                    key_of: Callable,
                    ops_of: Callable, checker: Any, invariant: Optional[str], next_extra: Callable,
                    parents: Any, path_to: Callable[[int], list[Op]], budget: Any, max_states: Optional[int],
                    ex: Expander) -> str:
    """The level loop of ``kvspec.mc.search.model_check`` over ``workers`` processes;
    fills ``res`` in and returns the verdict. ``ex`` checks ``budget``'s caps before each
    transition, in every process (a forked worker's memory is its own: each may grow by
    the cap); a chunk stopped by a cap ends the search, incomplete, after the merge."""
    unchecked: set = set()
    reg = registry(forker)
    frontier: list = [(encode(forker, forker.save(s0, lambda: []), reg), s0.obs, extra0, 0)]
    for d in range(1, depth + 1):
        last = d == depth
        budget.depth = d
        results, procs = run_level(workers, frontier, seen, unchecked, ex, last, reg)
        if procs > 1:
            res.split_levels += 1
        nxt: list = []
        for r in results:     # chunk by chunk, in frontier order: the one-process order
            res.transitions += r["transitions"]
            res.state_checks += r["state_checks"]
            for pos, i, op, kind, payload in r["records"]:
                idx = frontier[pos][3]
                if kind == FOUND:
                    res.counterexample, res.violations, res.depth = path_to(idx) + [op], payload, d
                    return "violation"
                if kind == PRUNED:
                    res.pruned += 1
                    continue
                if kind == RECHECKED:
                    unchecked.discard(payload)
                    continue
                k, checked, state, ex2 = payload
                if k in seen:   # another chunk found it first
                    if checked:
                        unchecked.discard(k)
                    continue
                seen.add(k)
                if not checked:
                    unchecked.add(k)
                pid = parents.append(idx, i)   # (kvspec.mc.trace.ParentLog)
                res.states += 1
                # (no state: its chunk's share timed out, and this level ends incomplete)
                nxt.append(None if last or state is None else (state[0], state[1], ex2, pid))
                if max_states is not None and res.states > max_states:
                    res.reason = f"state cap of {max_states} reached at depth {d}"
                    return "incomplete"
            if r["timeout"]:
                res.reason = r["reason"] or budget.time_reason()
                return "incomplete"
        res.levels.append(len(nxt))
        res.depth = d
        frontier = nxt
        if not nxt:
            res.exhausted = True
            break
    return "pass"
