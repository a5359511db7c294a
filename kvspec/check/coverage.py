"""What a run covered: the operations its machines drew, per level, and the target's
methods those operations called.

A verdict is only as strong as what the run tried: a pass at the engine level says
nothing of ``reset_prefix_cache``, which the engine level never draws. So every output
lists the operations drawn and never drawn at each level run, the target methods never
called, and, for a passing ``--patch`` run, each changed function the run never called,
with the level that does call it.

Counting is light: the machines note each op they apply (``note_op``, one dict
increment), and the classes of the target objects a driver holds (the driver's
attributes, three deep, from the target's own package: never kvspec's model or the
standard library) get their public methods wrapped once per class by a counting shim
(``instrument``). No per-call inspection.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import re
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Optional

_OPS: Counter = Counter()      # (level, op name) -> times drawn
_CALLS: Counter = Counter()    # (level, "Class.method") -> times called
_SEEN: dict[int, set] = {}     # level -> ids of instrumented classes seen at it (for "never called")
_CLASSES: dict[int, type] = {}  # id -> class, every class instrumented (kept alive)
_LEVEL = [""]                  # the level whose op is running (set by note_op / instrument)
_MARK = "__kvspec_counted__"
_SKIP_TOPS = ("builtins", "hypothesis", "torch", "numpy")  # never the code under test


def reset() -> None:
    """Start counting a new run."""
    _OPS.clear()
    _CALLS.clear()
    _SEEN.clear()


def note_op(op: Any) -> None:
    """The machines' one call per op they apply (the op's own level)."""
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


# -- what a patch changes -------------------------------------------------------------
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@")


def _source_of(rel: str) -> Optional[Path]:
    """The installed file a diff path names (vllm/..., impl/...), or None."""
    parts = Path(rel).parts
    if not parts:
        return None
    if parts[0] in ("impl", "kvspec"):
        from kvspec.targets.impl_target import ImplTarget
        tail = parts[1:] if parts[0] == "impl" else parts[2:] if len(parts) > 2 and parts[1] == "impl" else ()
        return ImplTarget.package_dir().joinpath(*tail) if tail else None
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    locs = list(getattr(spec, "submodule_search_locations", None) or []) if spec else []
    return Path(locs[0]).joinpath(*parts[1:]) if locs else None


def _functions_at(path: Path, lines: set[int]) -> list[str]:
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(child.lineno <= n <= (child.end_lineno or child.lineno) for n in lines):
                    found.append(prefix + child.name)
            if isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
    walk(tree, "")
    return found


def _hunks(patch_text: str) -> list[tuple[str, int, list[tuple[str, str]]]]:
    """(path, old start line, [(kind, text)]) per hunk of a unified diff."""
    out: list = []
    path = None
    for line in patch_text.splitlines():
        if line.startswith("--- "):
            name = line[4:].split("\t")[0].strip()
            path = name[2:] if name.startswith(("a/", "b/")) else name
        elif line.startswith("+++ "):
            continue
        elif _HUNK.match(line):
            out.append((path, int(_HUNK.match(line).group(1)), []))
        elif out and line[:1] in ("-", "+", " ", ""):
            out[-1][2].append((line[:1] or " ", line[1:]))
    return out


def changed_functions(patch_text: str) -> list[str]:
    """``Class.method`` (or ``function``) of each installed function a diff changes. A
    hunk is placed where its old lines are in the installed file (its header's line
    numbers may be off, as ``patch`` allows), else at its header."""
    out: list[str] = []
    for path, start, body in _hunks(patch_text):
        src = _source_of(path) if path else None
        if src is None or not src.is_file():
            continue
        text = src.read_text().splitlines()
        old = [t for k, t in body if k != "+"]
        first = start
        for i in range(len(text) - len(old) + 1):  # where the hunk really sits
            if text[i:i + len(old)] == old:
                first = i + 1
                break
        lines, n = set(), first
        for kind, _ in body:
            if kind == "-":
                lines.add(n)
                n += 1
            elif kind == "+":
                lines.add(max(n - 1, 1))  # an insertion: the line before it
            else:
                n += 1
        out.extend(f for f in _functions_at(src, lines) if f not in out)
    return out


def uncalled_notes(target: Any, patch_text: Optional[str], cov: dict, probe: bool = True) -> list[str]:
    """For a passing patch run: one line per changed function no level of the run called,
    with the level that does call it (from this run's levels, else a short probe)."""
    if not patch_text or not cov:
        return []
    notes = []
    for fn in changed_functions(patch_text):
        key = fn.split(".")[-1]
        if "." not in fn or key.startswith("_"):  # only public methods are counted: nothing to say
            continue
        def called(level_cov: dict) -> bool:
            return any(m == fn or m.endswith("." + key) for m in level_cov.get("methods_called", {}))
        if any(called(c) for c in cov.values()):
            continue
        ran = ", ".join(cov)
        where = [lv for lv, c in cov.items() if called(c)]
        if not where and probe:
            where = [lv for lv in _other_levels(target, cov) if _probe_calls(target, lv, key)]
        does = (f"the {where[0]} level does (--level {where[0]})" if where
                else "no level kvspec drove called it")
        notes.append(f"the {ran} level{'s' if len(cov) > 1 else ''} never called {key}; {does}")
    return notes


def _other_levels(target: Any, cov: dict) -> list[str]:
    levels = [lv for lv in getattr(target.traits, "levels", ("pool", "cache")) if lv not in cov]
    try:
        from kvspec.engine.drivers import supports_engine
        if "engine" not in cov and "engine" not in levels and supports_engine(target):
            levels.append("engine")
    except Exception:  # no engine level for this target
        pass
    return levels


PROBE_EXAMPLES = 10


def _probe_calls(target: Any, level: str, method: str) -> bool:
    """Whether ``PROBE_EXAMPLES`` seeded examples at ``level`` call ``method`` (a finding
    on the way is ignored: only the calls are asked about)."""
    from kvspec.check.search import LevelSearch

    saved_ops, saved_calls = Counter(_OPS), Counter(_CALLS)
    try:
        LevelSearch(target, level, misuse=False, seed=0).run_batch(PROBE_EXAMPLES)
        return any(lv == level and m.endswith("." + method) for (lv, m) in _CALLS)
    except Exception:
        return False
    finally:
        _OPS.clear(), _OPS.update(saved_ops)
        _CALLS.clear(), _CALLS.update(saved_calls)


SHOWN = 8  # never-called methods a text line names


def for_report(report: Any, target: Any, patch_text: Optional[str]) -> dict:
    """The coverage a report carries (``report.coverage``): per level, and the notes."""
    cov = snapshot(report.levels)
    passed = not report.violations and not getattr(report, "interrupted", None) and not getattr(report, "error", None)
    return {"levels": cov, "notes": uncalled_notes(target, patch_text, cov) if passed else []}


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
