"""Snapshot and restore of a live allocator *in place*, for the model checker's forks
(``GraphSnapshot``) and the impl drivers' ``snapshot()``/``restore()``.
"""
from __future__ import annotations

import types
import weakref
from typing import Any, Callable, Optional



# -- snapshot and restore in place, for the model checker's forks ----------------------
# ``kvspec mc`` tries every op from every state, so it puts one live allocator back into
# a saved state about twenty times per state found. Unpickling the object graph for each
# of those is most of a transition's cost. ``GraphSnapshot`` saves instead the mutable
# values of a fixed set of objects (the driver, the pool, the free queue and its two
# sentinels, every block; at cache level the manager too) and puts them back into those
# very objects: slot values (the queue links are references to the same blocks) with
# generated straight-line code, ``__dict__`` contents, and fresh copies of every list,
# dict and set reachable from them (the index, the tables, the requests).
#
# It is generic over the objects' layout, so a patched copy of the allocator (a bug of
# the corpus) is saved as faithfully as the original: every slot and every attribute of
# every object is saved, whatever it is called. Where a state holds anything this scheme
# cannot put back exactly (an object outside the set that is not a plain value, the same
# list reachable twice, an unset slot, an object whose class changed, a foreign block
# linked into the queue), ``capture`` returns None and the caller forks that state the
# slow way (pickle). Functions, classes and modules are shared, as pickle shares them.
_ATOMS = frozenset({int, float, bool, complex, str, bytes, type(None), type(Ellipsis), range, type,
                    types.FunctionType, types.BuiltinFunctionType, types.ModuleType})


class _Unsupported(Exception):
    pass


def _is_atom(v: Any) -> bool:
    t = type(v)
    if t in _ATOMS:
        return True
    if t is tuple or t is frozenset:
        for x in v:
            if not _is_atom(x):
                return False
        return True
    return False


def _slot_names(cls: type) -> Optional[tuple[str, ...]]:
    """The slots of a class without a ``__dict__`` (None if its instances have one)."""
    names: list[str] = []
    for c in reversed(cls.__mro__[:-1]):
        sl = c.__dict__.get("__slots__")
        if sl is None:
            return None  # a class in the chain without __slots__: instances have a __dict__
        for n in ((sl,) if isinstance(sl, str) else sl):
            if n == "__dict__":
                return None
            if n != "__weakref__" and n not in names:
                names.append(n)
    return tuple(names)


def _thaw_list(p: tuple) -> list:
    return [x if f is None else f(x) for f, x in p]


def _thaw_dict(p: tuple) -> dict:
    return {k: (x if f is None else f(x)) for k, f, x in p}


def _thaw_obj(p: tuple) -> Any:
    cls, static, conts = p
    o = object.__new__(cls)
    d = o.__dict__
    d.update(static)
    for k, f, x in conts:
        d[k] = f(x)
    return o


def _plain_value_class(cls: type) -> bool:
    """Instances can be rebuilt from their ``__dict__`` alone."""
    return (_slot_names(cls) is None and cls.__new__ is object.__new__ and cls.__init__ is not object.__init__
            and not issubclass(cls, BaseException))


class GraphSnapshot:
    """Save and restore, in place, the state of every object reachable from ``roots``
    (see the comment above). ``ok`` is False when the graph holds something this cannot
    handle even at the start; ``capture()`` returns None for a state it cannot save."""

    SLOTS_UNROLL_MAX = 4096   # slot values set by one generated function up to this many

    def __init__(self, roots: list) -> None:
        self.ok = True
        self.objs: list = []
        self.ids: dict[int, int] = {}
        try:
            for r in roots:
                self._discover(r)
        except _Unsupported:
            self.ok = False
            return
        self.slotted: list = []   # (obj, class, attrgetter, number of slots)
        self.dicted: list = []    # (obj, class)
        for o in self.objs:
            cls = type(o)
            names = _slot_names(cls)
            if names is None:
                self.dicted.append((o, cls))
            elif names:
                import operator
                self.slotted.append((o, cls, operator.attrgetter(*names), names))
        self._set_slots = self._compile_slot_setter()

    # -- discovery: which objects keep their identity ------------------------------
    def _discover(self, root: Any) -> None:
        stack = [root]
        seen: set[int] = set()
        while stack:
            v = stack.pop()
            if _is_atom(v) or id(v) in seen:
                continue
            seen.add(id(v))
            t = type(v)
            if t is list or t is tuple or t is set or t is frozenset:
                stack.extend(v)
            elif t is dict:
                for k in v:
                    if not _is_atom(k):
                        raise _Unsupported(f"a dict key of type {type(k).__name__}")
                stack.extend(v.values())
            else:
                names = _slot_names(t)
                if names is None:
                    d = getattr(v, "__dict__", None)
                    if type(d) is not dict:
                        raise _Unsupported(f"an object of type {t.__name__}")
                    vals = list(d.values())
                else:
                    try:
                        vals = [getattr(v, n) for n in names]
                    except AttributeError:
                        raise _Unsupported(f"an unset slot of {t.__name__}") from None
                if t.__module__ in ("builtins", "threading", "_thread", "io", "_io"):
                    raise _Unsupported(f"an object of type {t.__name__}")
                self.ids[id(v)] = len(self.objs)
                self.objs.append(v)
                stack.extend(vals)

    def _compile_slot_setter(self) -> Callable[[tuple], None]:
        total = sum(len(n) for _, _, _, n in self.slotted)
        objs = [o for o, _, _, _ in self.slotted]
        classes = [c for _, c, _, _ in self.slotted]
        if not self.slotted:
            return lambda states: None
        if total > self.SLOTS_UNROLL_MAX:
            names_of = [n for _, _, _, n in self.slotted]

            def set_slots(states: tuple) -> None:
                for o, c, names, vals in zip(objs, classes, names_of, states):
                    if o.__class__ is not c:
                        o.__class__ = c
                    for n, v in zip(names, vals):
                        setattr(o, n, v)
            return set_slots
        lines = ["def set_slots(states):"]
        lines.append("    " + ", ".join(f"s{i}" for i in range(len(objs))) + ", = states")
        for i, (_, _, _, names) in enumerate(self.slotted):
            lines.append(f"    if o{i}.__class__ is not c{i}: o{i}.__class__ = c{i}")
            lines.append("    " + ", ".join(f"o{i}.{n}" for n in names) + f", = s{i}")
        ns: dict = {f"o{i}": o for i, o in enumerate(objs)}
        ns.update({f"c{i}": c for i, c in enumerate(classes)})
        exec(compile("\n".join(lines), "<GraphSnapshot.set_slots>", "exec"), ns)
        return ns["set_slots"]

    # -- capture ---------------------------------------------------------------------
    def _plain(self, v: Any) -> bool:
        """Saved by reference: an atom, one of the objects restored in place, or a tuple
        or frozenset of those."""
        t = type(v)
        if t in _ATOMS:
            return True
        if t is tuple or t is frozenset:
            for x in v:
                if type(x) not in _ATOMS and not self._plain(x):
                    return False
            return True
        return id(v) in self.ids

    def _freeze(self, v: Any, seen: set) -> tuple:
        """(rebuild function, payload) for a container or a plain value object."""
        if id(v) in seen:
            raise _Unsupported("the same container reachable twice")
        seen.add(id(v))
        t = type(v)
        plain = self._plain
        if t is list:
            for x in v:
                if not plain(x):
                    return _thaw_list, tuple((None, x) if plain(x) else self._freeze(x, seen) for x in v)
            return list, tuple(v)
        if t is dict:
            for k, x in v.items():
                if type(k) not in _ATOMS and not _is_atom(k):
                    raise _Unsupported("a dict key that is not a plain value")
            for x in v.values():
                if not plain(x):
                    return _thaw_dict, tuple((k, None, x) if plain(x) else (k,) + self._freeze(x, seen)
                                             for k, x in v.items())
            return dict, tuple(v.items())
        if t is set:
            if all(_is_atom(x) for x in v):
                return set, tuple(v)
            raise _Unsupported("a set of objects")
        if t is not tuple and t is not frozenset and _plain_value_class(t):
            d = getattr(v, "__dict__", None)
            if type(d) is dict:
                static, conts = {}, []
                for k, x in d.items():
                    if plain(x):
                        static[k] = x
                    else:
                        conts.append((k,) + self._freeze(x, seen))
                return _thaw_obj, (t, static, tuple(conts))
        raise _Unsupported(f"a {t.__name__} that is neither plain nor restored in place")

    def capture(self) -> Optional[tuple]:
        """The state of every object, or None where it cannot be restored exactly."""
        try:
            plain, atoms, ids = self._plain, _ATOMS, self.ids
            slots = []
            for o, cls, get, names in self.slotted:
                if type(o) is not cls:
                    return None
                try:
                    vals = get(o)
                except AttributeError:
                    return None
                if len(names) == 1:
                    vals = (vals,)
                for x in vals:
                    if type(x) not in atoms and id(x) not in ids and not plain(x):
                        return None
                slots.append(vals)
            seen: set = set()
            dicts = []
            for o, cls in self.dicted:
                if type(o) is not cls:
                    return None
                static, conts = {}, []
                for k, x in o.__dict__.items():
                    if type(x) in atoms or id(x) in ids or plain(x):
                        static[k] = x
                    else:
                        conts.append((k,) + self._freeze(x, seen))
                dicts.append((static, tuple(conts)))
            return tuple(slots), tuple(dicts)
        except _Unsupported:
            return None

    def restore(self, state: tuple) -> None:
        slots, dicts = state
        self._set_slots(slots)
        for (o, cls), (static, conts) in zip(self.dicted, dicts):
            if o.__class__ is not cls:
                o.__class__ = cls
            d = o.__dict__
            d.clear()
            d.update(static)
            for k, f, x in conts:
                d[k] = f(x)


_GRAPHS: "weakref.WeakKeyDictionary[Any, GraphSnapshot]" = weakref.WeakKeyDictionary()


class _InPlaceSnapshots:
    """``snapshot()``/``restore(snap)`` for the impl drivers: save the allocator's state,
    and later put *this same driver* back into it (``restore`` returns ``self``). The
    snapshot is None where the state cannot be saved this way (see ``GraphSnapshot``)."""

    def snapshot(self) -> Optional[tuple]:
        g = _GRAPHS.get(self)
        if g is None:
            g = _GRAPHS[self] = GraphSnapshot([self])
        if not g.ok:
            return None
        snap = g.capture()
        return None if snap is None else (g, snap)

    def restore(self, snap: tuple) -> Any:
        g, state = snap
        if g is not _GRAPHS.get(self):
            raise ValueError("a snapshot is restored only into the driver that took it")
        g.restore(state)
        return self

    snapshot.in_place = True  # type: ignore[attr-defined]
