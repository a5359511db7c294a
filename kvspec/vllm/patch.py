"""Import the installed vLLM's allocator modules, optionally with an upstream-style
diff applied, without ever writing the installed files.

A diff names files relative to vLLM's repository root (``vllm/v1/core/block_pool.py``),
exactly as in an upstream PR. It is applied in memory to the installed text, and the
result is written to kvspec's per-process temporary directory. Then, for one import
window, every already-imported ``vllm.v1.core.*`` / ``vllm.v1.request`` module (and
any other patched module) is taken out of ``sys.modules`` and a meta-path finder
serves the patched files under their real names, so the whole family is re-executed
against the patched code (dependents bind the patched classes, and vLLM's own
absolute imports keep working). Afterwards the originals are put back: the process
keeps the unpatched vLLM, and each patched family lives on only through the modules
its target holds. So several patches can be loaded in one process, side by side.
The rest of the installed package (torch, vllm.config, ...) is shared, not re-run.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

from kvspec.patching import PatchError, apply_unified_diff, parse_unified_diff, read_inside, write_inside
from kvspec.targets.patched import _tmp_dir

# What the adapter drives; importing these pulls in the rest of the family.
ENTRY_MODULES = (
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.request",
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.kv_cache_interface",
    "vllm.sampling_params",
)
# Imported too where the release ships them (vllm.utils.hashing: 0.13.0 on); an older
# release must never be asked for a module only newer ones have.
OPTIONAL_MODULES = ("vllm.utils.hashing",)
# Re-executed for every patch, patched or not, so that they bind the patched classes.
# The spec registry is module-global state mapping KV-cache specs to manager classes:
# each family gets its own, filled with its own (patched) managers.
FAMILY = ("vllm.v1.core", "vllm.v1.request", "vllm.v1.kv_cache_spec_registry")

_loaded: dict[str, dict[str, ModuleType]] = {}  # diff digest -> modules (one load per diff)


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _import_entry(extra: tuple[str, ...] = ()) -> dict[str, ModuleType]:
    mods = {name: importlib.import_module(name) for name in ENTRY_MODULES + tuple(extra)}
    for name in OPTIONAL_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # its parent package is missing too
            found = False
        if found:
            mods[name] = importlib.import_module(name)
    return mods


def vllm_root() -> Path:
    """The directory holding the installed ``vllm`` package (the repository-root analogue)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the vllm package is not installed")
    return Path(list(spec.submodule_search_locations)[0]).parent


def _module_name(rel: str) -> str:
    if not rel.startswith("vllm/") or not rel.endswith(".py"):
        raise PatchError(f"{rel}: not a Python file of the vllm package (diff paths are relative to vLLM's repository root)")
    name = rel[: -len(".py")].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


class _PatchedFinder(importlib.abc.MetaPathFinder):
    """Serves the patched copies under the original module names."""

    def __init__(self, files: dict[str, tuple[Path, Path]]) -> None:
        self.files = files  # module name -> (patched file, original file)

    def find_spec(self, name, path=None, target=None):
        entry = self.files.get(name)
        if entry is None:
            return None
        patched, original = entry
        # A patched package __init__ still finds its other submodules in the installed tree.
        search = [str(original.parent)] if original.name == "__init__.py" else None
        return importlib.util.spec_from_file_location(name, patched, submodule_search_locations=search)


def import_vllm(patch_text: Optional[str] = None, extra: tuple[str, ...] = ()) -> dict[str, ModuleType]:
    """The modules in ``ENTRY_MODULES`` (and ``extra``, e.g. the engine level's
    ``vllm.v1.core.sched.scheduler``): the installed ones, or a patched family.

    Raises PatchError (one line, naming the file and hunk) for a diff that does not
    apply, and ImportError when vLLM itself cannot be imported.
    """
    if not patch_text:
        return _import_entry(extra)
    digest = hashlib.sha1((patch_text + "".join(extra)).encode()).hexdigest()[:12]
    if digest in _loaded:
        return _loaded[digest]
    root = vllm_root()  # finds the package without importing it: a bad diff fails fast
    for fp in parse_unified_diff(patch_text):  # every path checked before anything is read or written
        _module_name(fp.path)

    def read(rel: str) -> str:  # never through a link leading out of the vllm package
        return read_inside(root / "vllm", rel[len("vllm/"):])

    texts = apply_unified_diff(patch_text, read, under="vllm/", where="vLLM's repository root")
    dest = _tmp_dir() / f"vllm_{digest}"
    files: dict[str, tuple[Path, Path]] = {}
    for rel, text in texts.items():
        out = write_inside(dest, rel, text)
        files[_module_name(rel)] = (out, root / rel)

    _import_entry(extra)  # the originals, loaded before the swap, are what gets restored
    purge = FAMILY + tuple(files)
    before = set(sys.modules)
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if _in(n, purge)}
    finder = _PatchedFinder(files)
    sys.meta_path.insert(0, finder)
    try:
        mods = _import_entry(extra)
        for name in files:  # a patched module the entry chain does not reach still loads
            importlib.import_module(name)
        # The registry fills itself lazily through an import inside a function, which
        # after this window would reach the unpatched managers: fill it now.
        single = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
        if hasattr(single, "register_all_kvcache_specs"):  # releases with the registry only
            single.register_all_kvcache_specs(None)
    except (ImportError, SyntaxError):
        raise
    except Exception as e:  # patched code that raises at import: a target error, not a traceback
        raise ImportError(f"the patched vllm modules fail to import: {type(e).__name__}: {e}") from e
    finally:
        sys.meta_path.remove(finder)
        for n in set(sys.modules) - (before - set(saved)):
            del sys.modules[n]
        sys.modules.update(saved)
        for n, m in saved.items():  # `import a.b` binds b on a: point parents back too
            parent, _, child = n.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, m)
    _loaded[digest] = mods
    return mods
