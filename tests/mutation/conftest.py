"""Mutation testing support: run the test session against a mutant of kvspec.impl.

Two ways to name the mutant, both read before any test module is collected (this is an
initial conftest of tests/mutation/, which the killing suite lists first):

- ``KVSPEC_IMPL_DIR=DIR``: the package in ``DIR`` (a copy of impl/ that a mutation tool
  such as cosmic-ray has mutated in place) is imported *as* ``kvspec.impl``. This is
  what tools/mutate.py uses with cosmic-ray: each worker owns a copy of impl/, so the
  real impl/ of the checkout is never touched.
- ``KVSPEC_MUTANT=PATH.diff``: a unified diff against impl/ is applied to a temporary
  copy through the same patched-import path ``kvspec check --patch`` uses.

Either way, unit tests elsewhere that do ``from kvspec import impl`` get the mutant too,
when they run in the same session as tests/mutation/test_kill.py."""
import importlib.util
import os
import sys
from pathlib import Path


def _drop_impl_modules() -> None:
    for name in [n for n in sys.modules if n == "kvspec.impl" or n.startswith("kvspec.impl.")]:
        del sys.modules[name]


def _load_impl_from(directory: str) -> None:
    import kvspec

    d = Path(directory).resolve()
    if not (d / "__init__.py").is_file():
        raise RuntimeError(f"KVSPEC_IMPL_DIR={directory}: no __init__.py there")
    _drop_impl_modules()
    spec = importlib.util.spec_from_file_location("kvspec.impl", d / "__init__.py",
                                                  submodule_search_locations=[str(d)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvspec.impl"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["kvspec.impl"]
        raise
    kvspec.impl = mod
    # Submodules resolve through the package's __path__ (the standard path finder runs
    # before the editable install's finder), so kvspec.impl.block etc. come from DIR.
    assert Path(sys.modules["kvspec.impl.block"].__file__).resolve().parent == d


def _swap_in_mutant(diff_path: str) -> None:
    import kvspec
    from kvspec.targets.impl_target import ImplTarget
    from kvspec.targets.patched import import_patched_copy

    original_dir = ImplTarget.package_dir()
    mutant = import_patched_copy(original_dir, "impl", Path(diff_path).read_text(), "mutant")
    _drop_impl_modules()
    sys.modules["kvspec.impl"] = mutant
    for name, mod in list(sys.modules.items()):
        if name.startswith(mutant.__name__ + "."):
            sys.modules["kvspec.impl." + name[len(mutant.__name__) + 1:]] = mod
    kvspec.impl = mutant
    # ImplTarget() would re-import the installed package dir; point it at the mutant.
    ImplTarget.package_dir = staticmethod(lambda: original_dir)


if os.environ.get("KVSPEC_IMPL_DIR"):
    _load_impl_from(os.environ["KVSPEC_IMPL_DIR"])
elif os.environ.get("KVSPEC_MUTANT"):
    _swap_in_mutant(os.environ["KVSPEC_MUTANT"])
