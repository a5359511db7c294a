"""The model checker over several machines: states partitioned by fingerprint, as in TLC's
distributed mode, on Ray (or in this process, for tests and for a machine without Ray).

Each of N partitions owns the states whose fingerprint is ``p (mod N)``: their seen set,
the part of each breadth-first level they own, and the trace records of the states they
found. A level runs in two phases. *Expand*: every partition expands its frontier states
with the one-process search's loop (``kvspec.mc.expand``, every enabled op driven and
checked), and sends each successor new to what it knows to the successor's owner:
fingerprint, the state (pickled: ``PickleFork``, since it leaves the process), its
parent's global number and the op's index. *Receive*: each owner keeps, in the order of
the senders and then of their records, the successors whose fingerprint it has not seen;
they make its part of the next level. So each level holds exactly the states the
one-process search finds at that depth (a level is the set of successors of the last
one less those seen: the order in which they are found does not change it), and the state
counts and levels are the one-process search's (tests/test_mc_distributed.py). The
first level with a failing transition gives the verdict, so a counterexample is a
shortest one; which one of that length (the smallest parent number, then op index) can
differ from the one-process search's, since numbering follows the partitions.

A state's global number is ``p + N * i`` (its partition, its number there); the path to
it is walked back across the partitions' trace files and replayed (``kvspec.mc.trace``).

Resumable: with ``checkpoint=DIR`` every partition writes, after each level, its seen
set, its next level and its trace to DIR, and the search a manifest (``manifest.json``:
the levels done, the counters); ``resume=True`` starts from the last complete level.
``stop_after`` (levels) stops a search early, as a kill would, for the tests.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any, Optional

from kvspec.check.session import Session
from kvspec.mc.canonical import KeyMemo
from kvspec.mc.enumerate_ops import Bounds
from kvspec.mc.expand import FOUND, NEW, PRUNED, RECHECKED, Expander
from kvspec.mc.fingerprint import FingerprintSet, collision_odds
from kvspec.mc.fork import PickleFork
from kvspec.mc.parallel import flat_obs, obs_of
from kvspec.mc.search import MCResult, _next_extra, op_lister
from kvspec.mc.split import StepChecker
from kvspec.mc.trace import ParentLog, replay_path
from kvspec.spec.config import Config
from kvspec.targets import load_target


class Partition:
    """One partition's states (a Ray actor on a cluster, a plain object otherwise)."""

    def __init__(self, target: str, patch: Optional[str], config: Config, bounds: Bounds, p: int, n: int,
                 checkpoint: Optional[str], resume: bool, invariant: Optional[str] = None) -> None:
        self.p, self.n, self.config, self.bounds = p, n, config, bounds
        self.target = load_target(target, patch=patch)
        self.cache = config.level == "cache"
        s0 = Session(self.target, config, incremental=False)
        self.s0_obs = s0.obs
        self.extra0: dict = {"next_request": 1, "prompt_lens": {}} if self.cache else {}
        self.fork = PickleFork(s0)
        checker = StepChecker()
        self.fork.shared["step_check"] = checker
        s0.step_check = checker
        self.ops_of = op_lister(config, bounds, getattr(self.target.traits, "unsupported_ops", frozenset()))
        self.key_of = KeyMemo(config.level, bounds.symmetry, fingerprints=True)
        self.ex = Expander(self.fork, self.ops_of, self.key_of, checker, self._next_extra, invariant)
        self.dir = Path(checkpoint) if checkpoint else None
        trace_path = str(self.dir / f"trace-{p}.bin") if self.dir else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        if resume and self.dir is not None and (self.dir / f"part-{p}.pkl").exists():
            saved = pickle.loads((self.dir / f"part-{p}.pkl").read_bytes())
            self.depth = saved["depth"]
            self.seen = FingerprintSet.from_bytes(saved["seen"])
            self.unchecked, self.frontier, self.count = saved["unchecked"], saved["frontier"], saved["count"]
            self.trace = ParentLog(path=trace_path, initial=False)
            self.trace.on_disk = min(self.trace.on_disk, self.count)   # records past the checkpoint are redone
            self.trace.f.truncate(16 * self.trace.on_disk)
        else:
            if trace_path and os.path.exists(trace_path):
                os.unlink(trace_path)
            self.seen, self.unchecked, self.frontier, self.count = FingerprintSet(), set(), [], 0
            self.trace = ParentLog(path=trace_path, initial=False) if trace_path else ParentLog(initial=False)
            k0 = self.key_of(s0, self.extra0)
            if k0 % n == p:   # this partition owns the initial state: its number p, parent -1
                self.seen.add(k0)
                self.trace.append(-1, -1)
                self.count = 1
                self.frontier = [(self.fork.save(s0, list), flat_obs(s0.obs), self.extra0, p)]
        self.next: list = []
        self.depth = getattr(self, "depth", 0)   # the level its checkpoint holds
        self.transitions = self.pruned = 0

    def _next_extra(self, extra: dict, op: Any) -> dict:
        return _next_extra(extra, op) if self.cache else extra

    def node(self) -> str:
        """The Ray node it runs on ("local" outside Ray: asking Ray there would start one)."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return "local"
        return ray.get_runtime_context().get_node_id()

    def expand(self, last: bool) -> list:
        """Phase 1: this partition's frontier expanded; one outbox per partition (the
        last entry: ``found``, the failing transitions as (parent, op index, violations))."""
        out: list[list] = [[] for _ in range(self.n)]
        found: list = []
        local: set = set()
        t0 = self.ex.transitions
        for saved, obs, extra, gid in self.frontier:
            if found:   # (states come in increasing number: none after it can come first)
                break
            for i, op, kind, payload in self.ex.expand(saved, obs_of(obs), extra, self.seen, self.unchecked, local):
                if kind == FOUND:
                    found.append((gid, i, payload))
                    break   # no later transition of this state can come first
                if kind == PRUNED:
                    self.pruned += 1
                elif kind == RECHECKED:
                    self.unchecked.discard(payload)
                elif kind == NEW:
                    k, checked, s, ex2 = payload
                    local.add(k)
                    state = None if last else (self.fork.save(s, list), flat_obs(s.obs))
                    out[k % self.n].append((k, checked, state, ex2, gid, i))
        self.transitions += self.ex.transitions - t0
        self.frontier = []
        return out + [found]

    def receive(self, *boxes: list) -> int:
        """Phase 2: the successors this partition owns, new ones kept (senders in order);
        how many were new."""
        new = 0
        for box in boxes:
            for k, checked, state, ex2, parent, i in box:
                if k in self.seen:
                    if checked:
                        self.unchecked.discard(k)
                    continue
                self.seen.add(k)
                if not checked:
                    self.unchecked.add(k)
                gid = self.p + self.n * self.count
                self.count += 1
                self.trace.append(parent, i)
                new += 1
                if state is not None:
                    self.next.append((state[0], state[1], ex2, gid))
        self.frontier, self.next = self.next, []
        return new

    def checkpoint(self, depth: int) -> None:
        if self.dir is None:
            return
        self.trace.flush()
        self.trace.f.flush()
        tmp = self.dir / f"part-{self.p}.pkl.tmp"
        tmp.write_bytes(pickle.dumps({"seen": self.seen.to_bytes(), "unchecked": self.unchecked, "depth": depth,
                                      "frontier": self.frontier, "count": self.count}, pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, self.dir / f"part-{self.p}.pkl")

    def checkpoint_depth(self) -> int:
        return self.depth

    def counters(self) -> dict:
        return {"transitions": self.transitions, "pruned": self.pruned, "states": len(self.seen),
                "seen_bytes": self.seen.nbytes, "fingerprints": self.seen.to_bytes()}

    def record(self, i: int) -> tuple[int, int]:
        return self.trace.record(i)

    def close(self) -> None:
        self.trace.close()


class _Local:
    """Calls a partition's methods in this process (``use_ray=False``)."""

    def __init__(self, part: Partition) -> None:
        self.part = part

    def call(self, name: str, *args: Any, returns: int = 1) -> Any:
        return getattr(self.part, name)(*args)


class _OnRay:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def call(self, name: str, *args: Any, returns: int = 1) -> Any:
        m = getattr(self.actor, name)
        return (m.options(num_returns=returns) if returns != 1 else m).remote(*args)


def distributed_check(target: str, config: Config, depth: int, bounds: Optional[Bounds] = None, *,
                      partitions: int = 2, patch: Optional[str] = None, use_ray: bool = True,
                      ray_address: Optional[str] = None, checkpoint: Optional[str] = None, resume: bool = False,
                      stop_after: Optional[int] = None, invariant: Optional[str] = None,
                      time_cap: Optional[float] = None) -> MCResult:
    """Breadth-first search of every state within ``depth`` ops over ``partitions``
    partitions (Ray actors, one CPU each, with ``use_ray``; a running Ray, or the cluster
    at ``ray_address``, is used as it is, else a local one is started). See the module doc.
    ``time_cap`` is checked between levels (a level runs to its end): past it the search
    stops, ``incomplete`` (with ``checkpoint``, resumable from there)."""
    t0 = time.monotonic()
    bounds = bounds or Bounds()
    n = partitions
    args = (target, patch, config, bounds)
    if use_ray:
        import ray
        if not ray.is_initialized():
            ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=False)
        Actor = ray.remote(num_cpus=1)(Partition)
        # one actor per node where there are several (SPREAD), as TLC's workers are
        handles: list = [_OnRay(Actor.options(scheduling_strategy="SPREAD").remote(
            *args, p, n, checkpoint, resume, invariant)) for p in range(n)]
        get = ray.get
    else:
        handles = [_Local(Partition(*args, p, n, checkpoint, resume, invariant)) for p in range(n)]
        get = _identity
    res = MCResult("pass", config, bounds, depth, check_once=True, workers=n)
    res.fork = "pickle"
    manifest = Path(checkpoint) / "manifest.json" if checkpoint else None
    start = 1
    res.levels = [1]
    if resume and manifest is not None and manifest.exists():
        m = json.loads(manifest.read_text())
        start, res.levels, res.pruned = m["depth"] + 1, m["levels"], m.get("pruned", 0)
        res.depth = m["depth"]
        if m["partitions"] != n or set(get([h.call("checkpoint_depth") for h in handles])) != {m["depth"]}:
            raise ValueError(f"kvspec mc: the checkpoint in {checkpoint} is not one complete level of "
                             f"{n} partitions (a kill between its files?): start afresh")
    try:
        for d in range(start, depth + 1):
            last = d == depth
            boxes = [h.call("expand", last, returns=n + 1) for h in handles]
            if not use_ray:
                boxes = [list(b) for b in boxes]
            found = [f for b in boxes for f in get(b[n])]
            if found:
                gid, i, violations = min(found, key=lambda f: (f[0], f[1]))
                if invariant is None or violations[0].invariant == invariant:
                    res.verdict, res.depth, res.violations = "violation", d, violations
                    res.counterexample = _path(handles, get, n, target, patch, config, bounds, gid, i)
                    break
            news = get([h.call("receive", *[boxes[q][p] for q in range(n)]) for p, h in enumerate(handles)])
            res.levels.append(sum(news))
            res.depth = d
            if manifest is not None:
                get([h.call("checkpoint", d) for h in handles])
                tmp = manifest.with_suffix(".tmp")
                tmp.write_text(json.dumps({"depth": d, "levels": res.levels, "partitions": n, "pruned": res.pruned}))
                os.replace(tmp, manifest)
            if not sum(news):
                res.exhausted = True
                break
            if time_cap is not None and time.monotonic() - t0 > time_cap and d < depth:
                res.verdict, res.reason = "incomplete", f"time cap of {time_cap:g} s reached after depth {d}"
                break
            if stop_after is not None and d - start + 1 >= stop_after:
                res.verdict, res.reason = "incomplete", f"stopped after depth {d} (stop_after)"
                break
        cs = get([h.call("counters") for h in handles])
        res.transitions = sum(c["transitions"] for c in cs)
        res.pruned += sum(c["pruned"] for c in cs)
        res.states = sum(c["states"] for c in cs)
        res.seen_bytes = sum(c["seen_bytes"] for c in cs)
        fps = FingerprintSet.from_bytes(b"".join(c["fingerprints"] for c in cs))
        res.collision = collision_odds(len(fps), fps)
        res.nodes = sorted(set(get([h.call("node") for h in handles])))  # type: ignore[attr-defined]
    finally:
        get([h.call("close") for h in handles])
    res.seconds = time.monotonic() - t0
    return res


def _identity(x: Any) -> Any:
    return x


def _path(handles: list, get: Any, n: int, target: str, patch: Optional[str], config: Config, bounds: Bounds,
          gid: int, i: int) -> list:
    """The ops to state ``gid`` then op ``i``: walked back across the partitions' traces, replayed."""
    idx = [i]
    while True:
        parent, k = get(handles[gid % n].call("record", gid // n))
        if parent < 0:
            break
        idx.append(k)
        gid = parent
    t = load_target(target, patch=patch)
    cache = config.level == "cache"
    ops_of = op_lister(config, bounds, getattr(t.traits, "unsupported_ops", frozenset()))
    extra0: dict = {"next_request": 1, "prompt_lens": {}} if cache else {}
    return replay_path(idx[::-1], lambda: Session(t, config, incremental=False), ops_of, extra0,
                       lambda e, op: _next_extra(e, op) if cache else e)
