"""Importing a few modules of a large upstream package without running its package
``__init__`` (which pulls in GPU-only or serving-stack dependencies).

While the ``with`` body of ``stand_ins`` runs, plain stub modules stand in for the
named packages (with ``__path__`` set to the real directory, so their submodules load
from the installed files under their real names) and for the named leaf modules (with
only the attributes given: used where the real module is imported for a type name or
an optional feature the driven code never calls). Afterwards the stand-ins are removed
again, so a later ``import PACKAGE`` runs the real ``__init__``; the modules imported
meanwhile stay in ``sys.modules`` and keep what they bound.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional

from kvspec.errors import TargetError


def package_dir(package: str, target: str, install: str) -> Path:
    """The installed directory of ``package`` (its ``__init__`` is not run), or a
    TargetError naming what to install."""
    mod = sys.modules.get(package)
    if mod is not None and getattr(mod, "__path__", None):
        return Path(list(mod.__path__)[0])
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(f"target {target}: package {package!r} is not installed ({install})")
    return Path(list(spec.submodule_search_locations)[0])


@contextlib.contextmanager
def stubbed(packages: Iterable[tuple[str, Path]],
            leaves: Optional[Mapping[str, Mapping[str, Any]]] = None) -> Iterator[None]:
    """For the ``with`` body: each (name, directory) of ``packages`` not yet imported is an
    empty package with that ``__path__``; each of ``leaves`` (module name -> attributes) a
    stand-in module. All are removed afterwards."""
    added = []
    for name, d in packages:
        if name not in sys.modules:
            stub = types.ModuleType(name, "kvspec stand-in: the real __init__ is not run")
            stub.__path__ = [str(d)]
            sys.modules[name] = stub
            added.append(name)
    for name, attrs in (leaves or {}).items():
        if name not in sys.modules:
            stub = types.ModuleType(name, "kvspec stand-in: never called by the driven code")
            stub.__dict__.update(attrs)
            sys.modules[name] = stub
            added.append(name)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def stand_ins(root: Path, packages: tuple[str, ...],
              leaves: Optional[Mapping[str, Mapping[str, Any]]] = None):
    """``packages``: dotted names under ``root``'s package that get an empty stub
    ``__init__``; ``leaves``: module name -> attributes of a stand-in module."""
    return stubbed([(name, root.joinpath(*name.split(".")[1:])) for name in packages], leaves)
