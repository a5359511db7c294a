"""Saved states packed into bytes: for the trip between the parallel search's processes
(``kvspec.mc.parallel``) and for a large search's frontier (``kvspec.mc.search``,
``PACK_AT``).

The in-place fork's saved state (slot values, list and dict copies) points at the live
objects it is restored into. Packed, it is pickled with those objects as references
(``registry``: by ``id``; a forked worker's copies of them have the same ids) and
modules by name, so a state costs about a third of its unpacked memory and unpacks
into exactly what was saved. The pickle fork's states are bytes already and pass as
they are. ``can_pack`` tests the round trip once, on the initial state.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

from kvspec.check.session import Session
from kvspec.mc.fork import _DISPATCH, CompactFork, Fork, PickleFork, _is_scalar


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


def can_pack(forker: Fork, s0: Session) -> bool:
    """Can this search's saved states be packed (pickled, and put back faithfully)? Only
    the in-place and the pickle forks' can; a search with another fork runs in one
    process and keeps its frontier as it is."""
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
