"""The killing suite's stateful part (mutation testing of impl: tools/mutate.py):
kvspec's machines on impl, the same ``LevelSearch`` that ``kvspec check`` runs without
the minimizer, on pool and cache level, under valid use and with misuse mixed in, for
``KVSPEC_KILL_BUDGET`` seconds each (default 2 under a mutant, 0.5 in the default
pytest run), seed 0.

Without ``KVSPEC_IMPL_DIR``/``KVSPEC_MUTANT`` it runs on the real impl and must find
nothing; with either (see conftest.py) it runs on the mutant, and a finding kills it."""
import os
import time

import pytest

from kvspec import impl
from kvspec.check.search import LevelSearch
from kvspec.targets.impl_target import ImplTarget

# Seconds per machine: tools/mutate.py sets KVSPEC_KILL_BUDGET (2 by default); in the
# default pytest run, on the real impl, this is a quick smoke test (0.5 s each).
_MUTANT = bool(os.environ.get("KVSPEC_IMPL_DIR") or os.environ.get("KVSPEC_MUTANT"))
BUDGET = float(os.environ.get("KVSPEC_KILL_BUDGET", "2" if _MUTANT else "0.5"))


def hunt(level: str, misuse: bool, budget: float = BUDGET, seed: int = 0):
    """kvspec check's search without the minimizer: the first finding, or None."""
    search = LevelSearch(ImplTarget(impl), level, misuse=misuse, seed=seed)
    end = time.monotonic() + budget
    while time.monotonic() < end:
        found = search.run_batch()
        if found:
            return found
        if search.robust:
            return next(iter(search.robust.values()))
    return None


@pytest.mark.parametrize("level", ["pool", "cache"])
@pytest.mark.parametrize("misuse", [False, True], ids=["valid", "misuse"])
def test_machines_find_nothing(level, misuse):
    f = hunt(level, misuse)
    assert f is None, f"{f.invariant}: {f.violations[0].message} after {f.steps}"
