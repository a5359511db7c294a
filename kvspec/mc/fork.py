"""Forking a session for the model checker: the ways a search puts one state back to try
each op from it (see ``kvspec.mc.search``'s docstring), and ``choose_fork``.

The model checker's sessions are full ones (``incremental=False``): an incremental
session's live observation cannot be saved in place, and without the in-place fork a
search of 64 blocks or more fell back to replaying every path (several times slower).
"""
from __future__ import annotations

import copy
import copyreg
import importlib
import io
import pickle
import sys
import types
from typing import Any, Callable

from kvspec.errors import UsageError
from kvspec.spec.ops import Op
from kvspec.check.session import Session


# -- forking a session -------------------------------------------------------------
# step_check: the search's own check hook (kvspec.mc.search), shared by every copy, never pickled.
# output / _streams / _hangs (kvspec.check.session): where the target's prints go and the hangs
# seen, per search rather than per state (the streams do not pickle; a state saved in place
# cannot hold them either), so every copy shares the template's.
_SHARED_FIELDS = ("target", "config", "traits", "step_check", "output", "_streams", "_hangs")
_PER_STATE_FIELDS = ("obs", "steps", "initial", "last_result")


def _reduce_module(m: types.ModuleType):
    return importlib.import_module, (m.__name__,)


_DISPATCH = copyreg.dispatch_table.copy()
_DISPATCH[types.ModuleType] = _reduce_module


def _dumps(obj: Any) -> bytes:
    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = _DISPATCH
    p.dump(obj)
    return f.getvalue()


class Fork:
    """Saves a session's state and makes independent live copies of it."""

    name = "?"

    def __init__(self, template: Session) -> None:
        self.shared = {k: getattr(template, k, None) for k in _SHARED_FIELDS}

    def _fresh(self, state: dict, obs) -> Session:
        s = Session.__new__(Session)
        s.__dict__.update(self.shared)
        s.__dict__.update(state)
        s.obs, s.steps, s.initial, s.last_result = obs, [], [], None
        return s

    @staticmethod
    def _mutable(s: Session) -> dict:
        return {k: v for k, v in s.__dict__.items() if k not in _SHARED_FIELDS and k not in _PER_STATE_FIELDS}

    def save(self, s: Session, path: Callable[[], list[Op]]) -> Any:
        raise NotImplementedError

    def load(self, saved: Any, obs) -> Session:
        raise NotImplementedError


class PickleFork(Fork):
    name = "pickle"

    def save(self, s, path):
        return _dumps(self._mutable(s))

    def load(self, saved, obs):
        return self._fresh(pickle.loads(saved), obs)


class DriverSnapshotFork(Fork):
    """The driver's own ``snapshot()``/``restore(snap)``; the rest is pickled."""

    name = "driver-snapshot"

    def save(self, s, path):
        rest = self._mutable(s)
        drv = rest.pop("driver")
        return drv.snapshot(), _dumps(rest), drv

    def load(self, saved, obs):
        snap, rest, drv = saved
        state = pickle.loads(rest)
        state["driver"] = drv.restore(snap)
        return self._fresh(state, obs)


class DeepcopyFork(Fork):
    name = "deepcopy"

    def __init__(self, template: Session) -> None:
        super().__init__(template)
        self.memo = {id(m): m for m in list(sys.modules.values()) if m is not None}
        for v in self.shared.values():
            self.memo[id(v)] = v

    def save(self, s, path):
        return copy.deepcopy(self._mutable(s), dict(self.memo))

    def load(self, saved, obs):
        return self._fresh(copy.deepcopy(saved, dict(self.memo)), obs)


class ReplayFork(Fork):
    """No copy at all: a fresh session replays the state's op prefix."""

    name = "replay"

    def save(self, s, path):
        return path()

    def load(self, saved, obs):
        s = Session(self.shared["target"], self.shared["config"], incremental=False)
        for op in saved:
            s.apply(op)
        s.steps = []
        s.step_check = self.shared.get("step_check")
        return s


class CompactFork(Fork):
    """One live session, put back into each saved state in place (the default for
    drivers whose ``snapshot()`` is marked ``in_place``, such as impl's).

    The driver saves and restores itself (``kvspec.targets.impl_target.GraphSnapshot``:
    slot values, attribute dicts and fresh copies of its lists and dicts, put back into
    the same objects); the model, the hash history and the shadow KV store are saved the
    same way. A state either cannot save exactly (``snapshot()`` or ``capture()`` gives
    None: something outside the known objects, a list reachable twice, ...) is pickled
    instead, and loading it gives a separate session, as ``PickleFork`` does.

    Loading is the hot path of a search (once per transition), so both restores run as
    generated straight-line code (``_compiled_restore``) doing exactly what
    ``GraphSnapshot.restore`` does, and the driver's restore is called directly on its
    graph (the check ``_InPlaceSnapshots.restore`` makes, that the snapshot is this
    driver's, is the identity test against the graph seen first)."""

    name = "compact"

    def __init__(self, template: Session) -> None:
        super().__init__(template)
        from kvspec.targets.snapshot import GraphSnapshot

        if template.incremental or not getattr(getattr(type(template.driver), "snapshot", None), "in_place", False):
            raise TypeError("no in-place snapshot for this session")
        self.live = template
        self.rest_names = [k for k in self._mutable(template) if k != "driver"]
        rest = [getattr(template, k) for k in self.rest_names]
        self.graph = GraphSnapshot([r for r in rest if not _is_scalar(r)])
        if not self.graph.ok:
            raise TypeError("the session's state cannot be saved in place")
        self.pickled = PickleFork(template)
        self.fallbacks = 0   # states that had to be pickled
        self._rest_restore = _compiled_restore(self.graph)
        self._driver_graph: Any = None   # the driver's own GraphSnapshot, once seen
        self._driver_restore: Any = None
        self._last_ids: tuple = ()
        self._last_fields: dict = {}

    def save(self, s, path):
        if s is self.live:
            snap = s.driver.snapshot()
            if snap is not None:
                rest = self.graph.capture()
                if rest is not None:
                    return (snap, rest, self._fields(s))
        self.fallbacks += 1
        return self.pickled.save(s, path)

    def _fields(self, s: Session) -> dict:
        # The session's other fields (the model and hash history objects, restored in
        # place, and a few scalars) are nearly always the same: states share one dict,
        # which ``load`` only reads. Compared by identity (the dict keeps the objects
        # alive, so their ids stay theirs).
        d = s.__dict__
        vals = [d[k] for k in self.rest_names]
        ids = tuple(map(id, vals))
        if ids != self._last_ids:
            self._last_ids, self._last_fields = ids, dict(zip(self.rest_names, vals))
        return self._last_fields

    def load(self, saved, obs):
        if type(saved) is bytes:
            return self.pickled.load(saved, obs)
        snap, rest, fields = saved
        s = self.live
        g = snap[0] if type(snap) is tuple and len(snap) == 2 else None
        if g is not None and g is self._driver_graph:
            self._driver_restore(snap[1])   # what ``driver.restore(snap)`` does, compiled
        else:
            drv = s.driver.restore(snap)
            if drv is not s.driver:
                s.driver = drv
            self._driver_graph, self._driver_restore = g, _compiled_restore(g) if g is not None else None
        self._rest_restore(rest)
        d = s.__dict__
        d.update(fields)
        d["obs"], d["steps"], d["initial"], d["last_result"] = obs, [], [], None
        return s


def _compiled_restore(g: Any) -> Callable[[tuple], None]:
    """``g.restore`` (a ``GraphSnapshot``: the impl drivers' in-place snapshots) as one
    generated straight-line function: for each object with a ``__dict__``, the same
    class check, ``clear``, ``update`` and thawed containers, in the same order, so
    the objects end in exactly the state ``g.restore`` leaves them in (tests/test_mc.py
    compares the two forks' state spaces). Only for a ``GraphSnapshot`` whose layout
    this knows; anything else keeps its own ``restore``."""
    dicted, set_slots = getattr(g, "dicted", None), getattr(g, "_set_slots", None)
    if type(dicted) is not list or set_slots is None or type(g).restore.__qualname__ != "GraphSnapshot.restore":
        return g.restore
    lines = ["def restore(state):", "    slots, dicts = state", "    set_slots(slots)"]
    if dicted:
        lines.append("    " + "".join(f"p{i}, " for i in range(len(dicted))) + "= dicts")
    ns: dict = {"set_slots": set_slots}
    for i, (o, cls) in enumerate(dicted):
        ns[f"o{i}"], ns[f"c{i}"] = o, cls
        lines += [f"    if o{i}.__class__ is not c{i}: o{i}.__class__ = c{i}",
                  f"    d = o{i}.__dict__", "    d.clear()", f"    d.update(p{i}[0])",
                  f"    for k, f, x in p{i}[1]: d[k] = f(x)"]
    exec(compile("\n".join(lines), "<CompactFork.restore>", "exec"), ns)
    return ns["restore"]


def _is_scalar(v: Any) -> bool:
    return v is None or type(v) in (int, bool, float, str)


FORKS = {"compact": CompactFork, "pickle": PickleFork, "deepcopy": DeepcopyFork, "replay": ReplayFork,
         "driver": DriverSnapshotFork}


def _faithful(fork: Fork, s0: Session, probe: list[Op], check: Callable[[], None] = lambda: None) -> bool:
    """Does a forked copy behave like a fresh session (observation after each probe op)?
    (With an in-place fork the copy *is* ``s0``: it is put back before each use.)"""
    obs0 = s0.obs
    saved = None
    try:
        saved = fork.save(s0, lambda: [])
        if fork.load(saved, obs0).driver.observe() != obs0:
            return False
        for op in probe:
            check()   # (each probe builds a fresh session: as large as the search's states)
            a = fork.load(saved, obs0)
            b = Session(s0.target, s0.config, incremental=False)
            ra, rb = a.apply(op), b.apply(op)
            if a.obs != b.obs or [v.invariant for v in ra] != [v.invariant for v in rb]:
                return False
            # and the copy is independent of its source
            if fork.load(saved, obs0).driver.observe() != obs0:
                return False
        return True
    except Exception:
        return False
    finally:
        if saved is not None:
            try:
                fork.load(saved, obs0)
            except Exception:
                pass


def choose_fork(s0: Session, probe: list[Op], strategy: str = "auto", check: Callable[[], None] = lambda: None) -> Fork:
    """The fork named by ``strategy``, or with ``auto`` the first that round-trips ``s0``
    faithfully (``_faithful``: a driver that cannot be pickled, one holding a
    ``threading.Lock`` say, fails that test and the next way is tried). A named way
    that cannot fork this target is a ``UsageError``, one line, not a traceback.
    ``check`` (the search's caps) runs before each try; its ``CapReached`` is a
    BaseException, so ``_faithful``'s ``except Exception`` lets it through."""
    if strategy != "auto":
        if strategy not in FORKS:
            raise UsageError(f"kvspec mc: unknown fork {strategy!r} (choose: auto, {', '.join(FORKS)})")
        try:
            fork = FORKS[strategy](s0)
        except TypeError as e:
            raise UsageError(f"kvspec mc: --fork {strategy} cannot fork this target ({e})") from None
        if strategy != "replay" and not _faithful(fork, s0, probe, check):
            raise UsageError(f"kvspec mc: --fork {strategy} cannot fork this target faithfully "
                             f"(its state does not round-trip); try --fork auto")
        return fork
    snapshot = getattr(type(s0.driver), "snapshot", None)
    order = (["compact"] if getattr(snapshot, "in_place", False) and not s0.incremental else []) \
        + (["driver"] if hasattr(s0.driver, "snapshot") and hasattr(s0.driver, "restore") else []) \
        + ["pickle", "deepcopy"]
    for name in order:
        check()   # the search's caps (kvspec.mc.budget): trying a way of forking copies a whole state
        try:
            fork = FORKS[name](s0)
        except TypeError:
            continue
        ok = _faithful(fork, s0, probe, check)
        if ok:   # (an in-place fork's test ends by putting s0 back into the initial state)
            return fork
        if name == "compact":
            _reset(s0)   # trying it drove s0 itself and it failed: start s0 afresh
    return ReplayFork(s0)


def _reset(s0: Session) -> None:
    """Put ``s0`` back into the initial state, in place (a fresh session's fields; no
    pickling, so a driver that cannot be pickled is fine)."""
    fresh = Session(s0.target, s0.config, incremental=False)
    keep = s0.__dict__.get("step_check")
    s0.__dict__.clear()
    s0.__dict__.update(fresh.__dict__)
    if keep is not None:
        s0.step_check = keep
