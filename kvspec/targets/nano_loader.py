"""Loading a nano-vllm-style package's block manager without running its package
``__init__`` (which imports torch models and GPU-only libraries), optionally with a
patch applied to temporary copies of its files.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.util
import sys
import types
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence as Seq

from kvspec.patching import PatchError, apply_unified_diff, parse_unified_diff, read_inside, write_inside
from kvspec.targets.base import TargetError
from kvspec.targets.stub_import import package_dir as _package_dir
from kvspec.targets.stub_import import stand_ins, stubbed


# -- importing with patched files ------------------------------------------------------
class _Overlay(importlib.abc.MetaPathFinder):
    def __init__(self, files: Mapping[str, Path]) -> None:
        self.files = files

    def find_spec(self, name, path=None, target=None):
        f = self.files.get(name)
        if f is None:
            return None
        pkg = [str(f.parent)] if f.name == "__init__.py" else None
        return importlib.util.spec_from_file_location(name, f, submodule_search_locations=pkg)


@contextlib.contextmanager
def import_overlay(files: Mapping[str, Path], sys_path: Seq[str] = ()) -> Iterator[None]:
    """For the ``with`` body, module name -> source file ``files`` are imported afresh
    from those files under their real names; afterwards ``sys.modules`` (and the parent
    packages' attributes) hold exactly what they held before, so the fresh modules live
    on only through the objects taken from them."""
    saved = {n: sys.modules.pop(n) for n in list(files) if n in sys.modules}
    parents = {}
    for n in files:
        parent, _, child = n.rpartition(".")
        if parent in sys.modules:
            parents[(parent, child)] = getattr(sys.modules[parent], child, _MISSING)
    finder = _Overlay(files)
    sys.meta_path.insert(0, finder)
    sys.path[:0] = list(sys_path)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for p in sys_path:
            sys.path.remove(p)
        for n in files:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
        for (parent, child), value in parents.items():
            mod = sys.modules.get(parent)
            if mod is None:
                continue
            if value is _MISSING:
                mod.__dict__.pop(child, None)
            else:
                setattr(mod, child, value)


_MISSING = object()


def patched_files(root: Path, prefix: str, diff_text: str, alias: str) -> dict[str, Path]:
    """Apply ``diff_text`` (paths relative to ``root``, all under ``prefix``) to copies of
    the files it names; return repository path -> patched copy in kvspec's temp dir."""
    from kvspec.targets.patched import _tmp_dir

    top = prefix.strip("/") if prefix.endswith("/") else ""  # a prefix "mod.py" names one file under root
    tree, strip = (root / top, len(top) + 1) if top else (root, 0)
    texts = apply_unified_diff(diff_text, lambda rel: read_inside(tree, rel[strip:]), under=prefix, where=str(root))
    dest = _tmp_dir() / f"{alias}_{hashlib.sha1(diff_text.encode()).hexdigest()[:10]}"
    return {rel: write_inside(dest, rel, text) for rel, text in texts.items()}


def module_name(rel: str) -> str:
    """``a/b/c.py`` -> ``a.b.c``; ``a/b/__init__.py`` -> ``a.b``."""
    parts = rel[:-3].split("/") if rel.endswith(".py") else rel.split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# -- loading nano-vllm without its __init__ -------------------------------------------
def _stub_packages(package: str, pkg_dir: Path):
    return stand_ins(pkg_dir, (package, f"{package}.engine"))


def package_dir(package: str) -> Path:
    return _package_dir(package, f"nanovllm:{package}", "pip install nano-vllm-fork --no-deps")


def load_nano(package: str = "nanovllm", patch_text: Optional[str] = None) -> tuple[type, type]:
    """(BlockManager, Sequence) from ``PACKAGE.engine``, patched if ``patch_text``."""
    pkg_dir = package_dir(package)
    bm_name, seq_name = f"{package}.engine.block_manager", f"{package}.engine.sequence"
    if not (pkg_dir / "engine" / "block_manager.py").is_file():
        raise TargetError(f"target nanovllm:{package}: {pkg_dir}/engine/block_manager.py does not exist")
    try:
        with _stub_packages(package, pkg_dir):
            if patch_text is None:
                bm, seq = importlib.import_module(bm_name), importlib.import_module(seq_name)
            else:
                files = {module_name(rel): f for rel, f in
                         patched_files(pkg_dir.parent, f"{package}/", patch_text, f"nanovllm_{package}").items()}
                # Re-run both entry modules even when unpatched, so they bind the patched ones.
                files.setdefault(seq_name, pkg_dir / "engine" / "sequence.py")
                files.setdefault(bm_name, pkg_dir / "engine" / "block_manager.py")
                with import_overlay(files):
                    seq, bm = importlib.import_module(seq_name), importlib.import_module(bm_name)
    except (TargetError, PatchError, SyntaxError):
        raise
    except Exception as e:  # ImportError of a dependency (xxhash, numpy), or the module's own failure
        raise TargetError(f"target nanovllm:{package}: cannot import {bm_name}: {type(e).__name__}: {e}") from None
    for mod, attr in ((bm, "BlockManager"), (seq, "Sequence")):
        if not isinstance(getattr(mod, attr, None), type):
            raise TargetError(f"target nanovllm:{package}: {mod.__name__} defines no class {attr}")
    return bm.BlockManager, seq.Sequence


# -- importing a module without its parent packages' __init__ ---------------------------
def _parent_dirs(modname: str) -> list[tuple[str, Path]]:
    """(name, directory) of each parent package of ``modname``, from the file system only."""
    parts = modname.split(".")[:-1]
    if not parts:
        return []
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: runs no package code
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    d = Path(list(spec.submodule_search_locations)[0])
    out = [(parts[0], d)]
    for i in range(1, len(parts)):
        d = d / parts[i]
        if not d.is_dir():
            return []
        out.append((".".join(parts[: i + 1]), d))
    return out


def stub_parents(modname: str):
    """For the ``with`` body, each parent package of ``modname`` not yet imported is a
    stand-in module with the real ``__path__``, so importing ``modname`` runs none of their
    ``__init__`` files (which in nano-vllm derivatives import torch models, flash-attn or
    torch_npu); the stand-ins are removed afterwards, the modules imported under them stay."""
    return stubbed(_parent_dirs(modname))


def import_module_light(modname: str) -> types.ModuleType:
    """``modname``, imported normally; if that fails on an import its parent packages'
    ``__init__`` makes (a GPU-only library), imported again with them stubbed out."""
    try:
        return importlib.import_module(modname)
    except ImportError as first:
        if modname in sys.modules:
            return sys.modules[modname]  # it ran to its end; what failed was a parent's __init__
        if not _parent_dirs(modname):
            raise
        try:
            with stub_parents(modname):
                return importlib.import_module(modname)
        except ImportError:
            raise first from None
