"""What a run covered: the operations its machines drew, per level, and the target's
methods those operations called.

A verdict is only as strong as what the run tried: a pass at the engine level says
nothing of ``reset_prefix_cache``, which the engine level never draws. So every output
lists the operations drawn and never drawn at each level run, the target methods never
called, and, for a passing ``--patch`` run, each changed function the run never called,
with the level that does call it (``coverage_notes``: it runs a search, which this module,
imported by the session, must not).

Counting is light: the machines note each op they apply (``note_op``, one dict
increment), and the classes of the target objects a driver holds (the driver's
attributes, three deep, from the target's own package: never kvspec's model or the
standard library) get their public methods wrapped once per class by a counting shim
(``instrument``). No per-call inspection.
"""
from __future__ import annotations

import functools
import sys
import types
from collections import Counter
from typing import Any, Iterable

_OPS: Counter = Counter()      # (level, op name) -> times drawn
_CALLS: Counter = Counter()    # (level, "Class.method") -> times called
_SEEN: dict[int, set] = {}     # level -> ids of instrumented classes seen at it (for "never called")
_CLASSES: dict[int, type] = {}  # id -> class, every class instrumented (kept alive)
_LEVEL = [""]                  # the level whose op is running (set by note_op / instrument)
_MARK = "__kvspec_counted__"
# Counting is on only for the runs that report it (``reset``: kvspec check, the pytest
# plugin). The model checker and benchmarks build sessions too and read no coverage: they
# need neither the walk over the driver's objects per session nor a count per call.
_ON = [False]
_SKIP_TOPS = ("builtins", "hypothesis", "torch", "numpy")  # never the code under test


def reset() -> None:
    """Start counting a new run (and turn counting on in this process)."""
    _ON[0] = True
    _OPS.clear()
    _CALLS.clear()
    _SEEN.clear()


def note_op(op: Any) -> None:
    """The machines' one call per op they apply (the op's own level)."""
    if not _ON[0]:
        return
    level = type(op).level
    _LEVEL[0] = level
    _OPS[(level, type(op).__name__)] += 1


def _counted(key: str, fn: Any) -> Any:
    @functools.wraps(fn)  # keeps the signature (inspect.signature follows __wrapped__)
    def shim(*args: Any, **kw: Any) -> Any:
        _CALLS[(_LEVEL[0], key)] += 1
        return fn(*args, **kw)
    setattr(shim, _MARK, key)
    return shim


def _wanted(cls: type) -> bool:
    """A class of the code under test: not kvspec's own (its bundled allocator, kvspec.impl,
    and patched copies, ``_kvspec_*``, are under test), not the standard library's."""
    mod = getattr(cls, "__module__", "") or ""
    top = mod.split(".")[0]
    if top == "kvspec":
        return mod.startswith("kvspec.impl")
    return bool(mod) and top not in sys.stdlib_module_names and top not in _SKIP_TOPS


def _instrument_class(cls: type) -> None:
    if id(cls) in _CLASSES:
        return
    _CLASSES[id(cls)] = cls
    for klass in cls.__mro__[:-1]:
        if not _wanted(klass) or klass.__dict__.get(_MARK + "class"):
            continue
        try:
            for name, fn in list(vars(klass).items()):
                if isinstance(fn, types.FunctionType) and not name.startswith("_") and not getattr(fn, _MARK, False):
                    setattr(klass, name, _counted(f"{klass.__name__}.{name}", fn))
            setattr(klass, _MARK + "class", True)
        except (TypeError, AttributeError):  # a class that refuses new attributes: not counted
            pass


def instrument(driver: Any, level: str, depth: int = 3) -> None:
    """Count calls on the target objects ``driver`` holds (its attributes, ``depth`` deep)."""
    if not _ON[0]:
        return
    _LEVEL[0] = level
    seen = _SEEN.setdefault(level, set())
    todo, visited = [(driver, 0)], set()
    while todo:
        obj, d = todo.pop()
        if id(obj) in visited or d > depth:
            continue
        visited.add(id(obj))
        cls = type(obj)
        if d > 0 and _wanted(cls):
            _instrument_class(cls)
            seen.add(id(cls))
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            todo += [(v, d + 1) for v in attrs.values()
                     if _wanted(type(v)) and not isinstance(v, (type, types.ModuleType))]


def _methods(cls: type) -> set[str]:
    """The counted methods an instance of ``cls`` offers (each under the class that defines it)."""
    names = {n for k in cls.__mro__[:-1] for n in vars(k) if not n.startswith("_")}
    return {getattr(cls, n).__dict__[_MARK] for n in names
            if isinstance(getattr(cls, n, None), types.FunctionType) and _MARK in getattr(cls, n).__dict__}


def snapshot(levels: Iterable[str]) -> dict:
    """What the run drew and called, per level: JSON-ready."""
    from kvspec.spec import ops as opsmod

    out: dict = {}
    for level in levels:
        vocab = sorted(c.__name__ for c in vars(opsmod).values()
                       if isinstance(c, type) and issubclass(c, opsmod.Op) and c is not opsmod.Op
                       and getattr(c, "level", "") == level)
        drawn = {name: n for (lv, name), n in _OPS.items() if lv == level}
        called = {m: n for (lv, m), n in _CALLS.items() if lv == level}
        offered = sorted({m for cid in _SEEN.get(level, ()) for m in _methods(_CLASSES[cid])})
        out[level] = {"ops_drawn": dict(sorted(drawn.items())),
                      "ops_never_drawn": [n for n in vocab if n not in drawn],
                      "methods_called": dict(sorted(called.items())),
                      "methods_never_called": [m for m in offered if m not in called]}
    return out


SHOWN = 8  # never-called methods a text line names


def coverage_lines(cov: dict, notes: list[str]) -> list[str]:
    """The text lines every human-readable output shows."""
    lines = []
    for level, c in cov.items():
        drawn = ", ".join(c["ops_drawn"]) or "none"
        never = ", ".join(c["ops_never_drawn"]) or "none"
        lines.append(f"  {level} level drew {drawn}; never drew {never}")
        uncalled = c["methods_never_called"]
        if uncalled:
            more = f" and {len(uncalled) - SHOWN} more (--json lists them)" if len(uncalled) > SHOWN else ""
            lines.append(f"  {level} level never called {', '.join(uncalled[:SHOWN])}{more}")
    lines += [f"  NOTE: {n}" for n in notes]
    return lines
