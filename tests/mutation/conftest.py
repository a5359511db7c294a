"""Mutation testing support (tools/mutate.py): with ``KVSPEC_MUTANT=PATH.diff`` set, the
whole test session sees a patched copy of kvspec.impl in its place, imported through
the same patched-import path ``kvspec check --patch`` uses. Loaded by pytest before any
test module is collected (it is an initial conftest of tests/mutation/), so unit tests
elsewhere that do ``from kvspec import impl`` get the mutant too, when run in the same
session as tests/mutation/test_kill.py (listed first)."""
import os
import sys
from pathlib import Path


def _swap_in_mutant(diff_path: str) -> None:
    import kvspec
    from kvspec.targets.impl_target import ImplTarget
    from kvspec.targets.patched import import_patched_copy

    original_dir = ImplTarget.package_dir()
    mutant = import_patched_copy(original_dir, "impl", Path(diff_path).read_text(), "mutant")
    for name in [n for n in sys.modules if n == "kvspec.impl" or n.startswith("kvspec.impl.")]:
        del sys.modules[name]
    sys.modules["kvspec.impl"] = mutant
    for name, mod in list(sys.modules.items()):
        if name.startswith(mutant.__name__ + "."):
            sys.modules["kvspec.impl." + name[len(mutant.__name__) + 1:]] = mod
    kvspec.impl = mutant
    # ImplTarget() would re-import the installed package dir; point it at the mutant.
    ImplTarget.package_dir = staticmethod(lambda: original_dir)


if os.environ.get("KVSPEC_MUTANT"):
    _swap_in_mutant(os.environ["KVSPEC_MUTANT"])
