"""Importing a user's ``FILE.py`` as the user's own code runs: under its real dotted name
when it sits in a package, without running the parent packages' ``__init__`` (which in
nano-vllm derivatives import torch models, flash-attn or torch_npu), with third-party
modules that are not installed stood in for when the import needs them only by name,
and bounded in time by ``--op-timeout``.

Where the package root is. A file's code says how it is imported: an absolute import of
its own top-level package (``from nanovllm.engine.sequence import Sequence`` in
``REPO/nanovllm/engine/block_manager.py``) names it, even where a directory on the way
has no ``__init__.py`` (nano-vllm's ``engine/``); otherwise the chain of directories
with ``__init__.py`` does, and relative imports (``from .sequence import Sequence``)
say at least how deep the package is. A file in no package keeps being executed as a
fresh module with its directory on ``sys.path`` (``user_target``).

Stand-ins for missing modules. Only when the import fails with ``ModuleNotFoundError``
for a top-level module that is not installed at all (and is not the user's own
package) is a stand-in module put in its place, with a note on stderr. Any attribute of
it is a stand-in object; used at import time (a decorator, a base class, a type in an
annotation) it returns more stand-ins, but calling one once the import is over raises
``TargetError`` (exit 2, naming the module): a manager that really needs the module
is never checked with a fake one.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

from kvspec.errors import TargetError
from kvspec.targets.stub_import import stubbed

MAX_STAND_INS = 8   # missing modules stood in for before giving up on an import
_loading = False    # while True, stand-ins may be called (decorators, class bodies at import)


# -- where the package is ---------------------------------------------------------------
def _imports(source: Path) -> tuple[set[str], int]:
    """(top-level names of the file's absolute imports, deepest relative import level)."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, OSError):
        return set(), 0
    tops, level = set(), 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops.update(a.name.split(".", 1)[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                level = max(level, node.level)
            elif node.module:
                tops.add(node.module.split(".", 1)[0])
    return tops, level


def package_root(path: Path) -> Optional[tuple[Path, str]]:
    """(the directory to put on sys.path, the file's dotted module name), or None for a
    file in no package. ``path`` is absolute."""
    tops, level = _imports(path)
    ancestors = list(path.parents)
    # 1. The file imports its own top-level package by name: the root is above it.
    for root in ancestors[1:]:
        rel = path.relative_to(root).with_suffix("").parts
        if rel[0] in tops and _dotted(rel):
            return root, ".".join(rel)
    # 2. The chain of __init__.py files, at least as deep as the relative imports reach.
    root = path.parent
    while (root / "__init__.py").is_file() and root.parent != root:
        root = root.parent
    depth = len(path.parent.relative_to(root).parts)
    if depth < level and len(path.parent.parts) > level:
        root = path.parents[level]
    if root == path.parent:
        return None
    rel = path.relative_to(root).with_suffix("").parts
    return (root, ".".join(rel)) if _dotted(rel) else None


def _dotted(parts: tuple[str, ...]) -> bool:
    return all(p.isidentifier() for p in parts)


# -- stand-ins for modules that are not installed ----------------------------------------
class StandIn:
    """What a missing module's attributes are (see the module doc)."""

    def __init__(self, name: str, *bases: Any, **kw: Any) -> None:
        # Also the metaclass path: ``class X(missing.Base)`` calls StandIn(name, bases, ns).
        self._kvspec_name = name if isinstance(name, str) else "?"

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self._kvspec_name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _loading:
            return StandIn(f"{self._kvspec_name}()")
        top = self._kvspec_name.split(".", 1)[0]
        raise TargetError(f"the target calls {self._kvspec_name}, but {top} is not installed "
                          f"(kvspec stood in for it only to import the target)")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (_StandInBase,)

    def __getitem__(self, item: Any) -> Any:  # Tensor[...] and the like in annotations
        return self

    def __repr__(self) -> str:
        return f"<kvspec stand-in {self._kvspec_name}>"


class _StandInBase:
    """The base class a ``class X(missing.Base)`` gets: building one is calling the module."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not _loading:
            raise TargetError(f"the target builds {type(self).__name__}, whose base class comes from a module "
                              f"that is not installed (kvspec stood in for it only to import the target)")


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self.__name__}.{attr}")


def _installed(top: str) -> bool:
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return True  # something is there, only broken: not ours to replace


def stand_in_module(name: str) -> None:
    """Put a stand-in module for ``name`` (and its parents) into ``sys.modules``."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        n = ".".join(parts[:i])
        if n not in sys.modules:
            mod = _StandInModule(n, "kvspec stand-in: the module is not installed")
            mod.__path__ = []  # a package, so its submodules can be stood in for too
            sys.modules[n] = mod
            if i > 1:
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], mod)


def missing_top(e: ImportError, own: str) -> Optional[str]:
    """The module ``e`` says is missing, if a stand-in may replace it: its top-level module
    is not installed at all (or is a stand-in already) and is not the user's own package
    ``own``. The whole dotted name is returned, so ``missing.sub`` gets its stand-in too."""
    name = getattr(e, "name", None)
    if not isinstance(e, ModuleNotFoundError) or not name:
        return None
    top = name.split(".", 1)[0]
    if top == own:
        return None
    if isinstance(sys.modules.get(top), _StandInModule):
        return name
    if top in sys.modules or _installed(top):
        return None
    return name


# -- importing ----------------------------------------------------------------------------
def _parent_chain(root: Path, modname: str) -> list[tuple[str, Path]]:
    parts = modname.split(".")[:-1]
    return [(".".join(parts[: i + 1]), root.joinpath(*parts[: i + 1])) for i in range(len(parts))]


def _foreign(top: str, root: Path) -> dict[str, types.ModuleType]:
    """Modules already imported under the user's top-level name from somewhere else (an
    installed nano-vllm when the user's fork is also called ``nanovllm``)."""
    mod = sys.modules.get(top)
    if mod is None:
        return {}
    paths = [Path(p).resolve() for p in (getattr(mod, "__path__", None) or [])]
    f = getattr(mod, "__file__", None)
    if f:
        paths.append(Path(f).resolve().parent)
    if (root / top).resolve() in paths or root.resolve() in paths:
        return {}
    return {n: m for n, m in sys.modules.items() if n == top or n.startswith(top + ".")}


def with_stand_ins(modname: str, own: str, note: Callable[[str], None], attempt: Callable[[], Any]) -> Any:
    """``attempt()`` (an import of ``modname``), again after each missing third-party module
    it fails on is stood in for (see the module doc; never the user's own package ``own``)."""
    global _loading
    stood_in = 0
    _loading = True
    try:
        while True:
            try:
                return attempt()
            except ImportError as e:
                missing = missing_top(e, own)
                if missing is None or stood_in >= MAX_STAND_INS:
                    raise
                stand_in_module(missing)
                stood_in += 1
                note(f"kvspec: note: stubbed missing module {missing} to import {modname}")
    finally:
        _loading = False


class _Current:
    """A stream that writes to whatever ``sys.stdout``/``sys.stderr`` is at the time of the write."""

    def __init__(self, which: str) -> None:
        self.which = which

    def write(self, text: str) -> int:
        return getattr(sys, self.which).write(text)

    def flush(self) -> None:
        getattr(sys, self.which).flush()


def reroute_logging() -> None:
    """Point the logging handlers a target set up at import (``StreamHandler(sys.stdout)``
    holds the real stdout, past kvspec's per-call capture, ``target_output``) at the current
    stream instead: a target's log lines then land in its captured output, never inside
    ``--json``'s one object on stdout."""
    import logging
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) \
                    and not isinstance(h.stream, _Current):
                which = _std_stream(h.stream)
                if which:
                    h.stream = _Current(which)


def _std_stream(stream: Any) -> str:
    """'stdout' or 'stderr' when ``stream`` writes to file descriptor 1 or 2, else ''."""
    if stream is sys.__stdout__:
        return "stdout"
    if stream is sys.__stderr__:
        return "stderr"
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return ""
    return {1: "stdout", 2: "stderr"}.get(fd, "")


def import_in_package(root: Path, modname: str, note: Callable[[str], None],
                      files: Optional[dict[str, Path]] = None) -> types.ModuleType:
    """Import ``modname`` from ``root`` under its real name (see the module doc).

    ``files``: module name -> source served in place of the file (a ``--patch``), for this
    import only (``nano_loader.import_overlay``)."""
    from kvspec.targets.nano_loader import import_overlay

    top = modname.split(".", 1)[0]
    here = str(root)
    if here in sys.path:
        sys.path.remove(here)
    sys.path.insert(0, here)  # the user's package comes before an installed one of that name
    foreign = _foreign(top, root)
    for n in foreign:
        del sys.modules[n]
    state = {"stub_parents": True}

    def attempt() -> types.ModuleType:
        while True:
            parents = _parent_chain(root, modname) if state["stub_parents"] else []
            try:
                with stubbed(parents):
                    if files:
                        with import_overlay(files):
                            return importlib.import_module(modname)
                    return importlib.import_module(modname)
            except ImportError as e:
                if state["stub_parents"] and missing_top(e, top) is None and _needs_parent_init(e, modname):
                    state["stub_parents"] = False  # it imports a name its package's __init__ defines: run it
                    continue
                raise

    try:
        return with_stand_ins(modname, top, note, attempt)
    finally:
        reroute_logging()
        if foreign:  # the installed package stays the one ``import NAME`` gives elsewhere
            for n in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                if n not in foreign:
                    sys.modules.pop(n, None)
            sys.modules.update(foreign)


def _needs_parent_init(e: ImportError, modname: str) -> bool:
    """An ImportError of a name from one of ``modname``'s parent packages (whose
    ``__init__`` a stand-in replaced)."""
    parents = set(n for n, _ in _parent_chain(Path("."), modname))
    return getattr(e, "name", None) in parents or any(f"from '{p}'" in str(e) for p in parents)


DEPENDENCY_LIMIT_S = 120.0  # an installed library's own import (torch takes 10 s and more on a busy machine)


def _import_targets(source: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(relative level, module, imported names) of every import statement in ``source``."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, OSError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(0, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or "", tuple(a.name for a in node.names)))
    return out


def _local_file(base: Path, dotted: str) -> Optional[Path]:
    """``base/a/b.py`` or ``base/a/b/__init__.py`` for ``a.b``, where it exists."""
    if not dotted:
        return None
    p = base.joinpath(*dotted.split("."))
    for f in (p.with_suffix(".py"), p / "__init__.py"):
        if f.is_file():
            return f
    return None


def _reached_files(path: Path, root: Optional[Path], own: str
                   ) -> tuple[list[Path], dict[str, set[tuple[str, tuple[str, ...]]]]]:
    """(the user's files ``path`` imports, transitively, itself first; the top-level names
    of the other, third-party, imports among them, each with its (module, names) statements). Only what the target's import can run:
    the files beside it that it never imports (a model runner importing torch and
    transformers) are not read, so their libraries are not loaded for nothing."""
    seen, todo = [path], [path]
    third: dict[str, set[tuple[str, tuple[str, ...]]]] = {}
    while todo:
        f = todo.pop()
        for level, module, names in _import_targets(f):
            if level:
                base = f.parent
                for _ in range(level - 1):
                    base = base.parent
                cands = [_local_file(base, module)] if module else []
                cands += [_local_file(base, f"{module}.{n}" if module else n) for n in names]
            else:
                top = module.split(".", 1)[0]
                cands = []
                if root is not None and top == own:
                    cands = [_local_file(root, module)] + [_local_file(root, f"{module}.{n}") for n in names]
                elif _local_file(path.parent, top) is not None:
                    cands = [_local_file(path.parent, module)]
                else:
                    third.setdefault(top, set()).add((module, names))
                    continue
            for c in cands:
                if c is not None and c not in seen:
                    seen.append(c)
                    todo.append(c)
    return seen, third


def import_dependencies(path: Path, root: Optional[Path], own: str) -> None:
    """Import the installed third-party libraries that ``path`` and the user's modules it
    imports (transitively) import, before the user's import is timed: ``--op-timeout``
    bounds the user's code, not torch's import time. A library that fails to import is
    left to the user's import (a stand-in if it is not installed)."""
    _, tops = _reached_files(path, root, own)
    local = {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir() if p.is_dir()}
    skip = set(sys.stdlib_module_names) | local | {own}
    for top in sorted(set(tops) - skip):
        if top in sys.modules:
            continue
        try:
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if found is None:
            continue
        origin = Path(found.origin or (list(found.submodule_search_locations or []) or ["."])[0]).resolve()
        if root is not None and root.resolve() in origin.parents:
            continue  # the user's own code, found on the path: timed with the rest
        try:
            bounded(max(DEPENDENCY_LIMIT_S, op_timeout() or 0), f"importing {top} (a library {path.name} needs)",
                    lambda: _import_statements(top, tops[top]))
        except TargetError:
            raise
        except BaseException as e:  # noqa: BLE001 - the user's import will say what is wrong
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise


def _import_statements(top: str, statements: set[tuple[str, tuple[str, ...]]]) -> None:
    """Run ``import module`` / ``from module import names`` for a library, names included:
    a lazy package (transformers) imports the heavy part only when a name is taken, and
    that must not fall inside the user's timed import (a verdict must not depend on load)."""
    importlib.import_module(top)
    for module, names in sorted(statements):
        try:
            mod = importlib.import_module(module)
            for n in names:
                if n != "*":
                    getattr(mod, n, None)
        except Exception:  # noqa: BLE001 - the user's import will say what is wrong
            continue


def bounded(seconds: Optional[float], what: str, fn: Callable[[], Any], why: str = "--op-timeout") -> Any:
    """``fn()``, or a TargetError if it has not returned within ``seconds``."""
    from kvspec.targets.watchdog import OpTimeout, guarded
    try:
        return guarded(seconds, fn)
    except OpTimeout as t:
        raise TargetError(f"{what} did not finish within {t.seconds:g} s ({why})") from None


def import_limit(top: str, where: Optional[Path] = None) -> tuple[Optional[float], str]:
    """(seconds, why) for importing the top-level package ``top``: ``--op-timeout`` for the
    user's own code (under the working directory), at least ``DEPENDENCY_LIMIT_S`` for an
    installed library (vLLM's import takes longer than a target call may)."""
    seconds = op_timeout()
    if where is None:
        try:
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            found = None
        origin = None if found is None else (found.origin or (list(found.submodule_search_locations or []) or
                                                               [None])[0])
        where = Path(origin) if origin else None
    if where and Path.cwd().resolve() not in Path(where).resolve().parents and seconds:
        return max(seconds, DEPENDENCY_LIMIT_S), f"an installed package: at least {DEPENDENCY_LIMIT_S:g} s"
    return seconds, "--op-timeout"


def op_timeout() -> Optional[float]:
    from kvspec.targets import watchdog
    return watchdog.default()
