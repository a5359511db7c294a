"""Hypothesis settings profiles of kvspec's machines under pytest (``ci``, ``dev``,
``deep``; see ``kvspec.pytest_plugin``): the one place they are defined.

A profile's ``max_examples`` is the number of examples a machine runs, counted as
``kvspec check`` counts them: every example run, those Hypothesis discards part-way
included (``kvspec.pytest_plugin.run_machine`` meets it in batches; Hypothesis's own
``max_examples`` counts only the examples it keeps, about 1 in 3 at the cache level).

``ci``'s count is sized from measurement (reports/profiles.md,
benchmarks/measure_profile_ci.py): every safety bug of the impl and vLLM corpora is
found at its level on seeds 0-2 within 319 examples; ``CI_EXAMPLES`` is twice that,
rounded, for seeds and corpus bugs not measured."""
from __future__ import annotations

import os
from typing import Any, Optional

STEPS = 60                 # steps per example, as kvspec check (about 5x the largest pool)
CI_EXAMPLES = 640          # 2x the most any corpus safety bug needed at seeds 0-2 (319: reports/profiles.md)

PROFILES: dict[str, dict[str, Any]] = {
    "ci": dict(max_examples=CI_EXAMPLES, stateful_step_count=STEPS, derandomize=True, database=None),
    "dev": dict(max_examples=50, stateful_step_count=STEPS, derandomize=False),
    "deep": dict(max_examples=5000, stateful_step_count=2 * STEPS, derandomize=False),
}
# Seconds of ddmin and of bounded shortest-path search when cutting a failure down under a
# random profile (a derandomized one, ci, and --kvspec-max-examples bound it by work instead).
MINIMIZE_BUDGET = {"ci": (5.0, 4.0), "dev": (5.0, 4.0), "deep": (20.0, 30.0)}


def _common() -> dict[str, Any]:
    from hypothesis import HealthCheck, Phase, Verbosity

    # Generation and replay only: a failure is cut down by kvspec.check.minimize (what
    # ``kvspec check`` does), which finds shorter sequences than shrinking, sooner.
    return dict(deadline=None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                phases=(Phase.explicit, Phase.reuse, Phase.generate), verbosity=Verbosity.quiet, print_blob=False)


def profile_settings(name: str, database: Optional[str] = None):
    """The Hypothesis ``settings`` of kvspec profile ``name`` (``database``: a directory)."""
    from hypothesis import settings

    if name not in PROFILES:
        raise ValueError(f"unknown kvspec profile {name!r}: choose {', '.join(PROFILES)}")
    kw = {**_common(), **PROFILES[name]}
    if database and not kw.get("derandomize"):
        from hypothesis.database import DirectoryBasedExampleDatabase
        kw["database"] = DirectoryBasedExampleDatabase(database)
    return settings(**kw)


def register_profiles() -> None:
    """Register ``kvspec-ci``, ``kvspec-dev`` and ``kvspec-deep`` with Hypothesis."""
    from hypothesis import settings

    for name in PROFILES:
        settings.register_profile(f"kvspec-{name}", profile_settings(name))


def _profile_name(value: str) -> str:
    return value[len("kvspec-"):] if value.startswith("kvspec-") else value


def choose_profile(explicit: Optional[str] = None) -> str:
    """The kvspec profile to run: see the module doc for the order."""
    for value in (explicit, os.environ.get("KVSPEC_PROFILE")):
        if value:
            if _profile_name(value) not in PROFILES:
                raise ValueError(f"unknown kvspec profile {value!r}: choose {', '.join(PROFILES)}")
            return _profile_name(value)
    hyp = os.environ.get("HYPOTHESIS_PROFILE")
    if hyp and _profile_name(hyp) in PROFILES:  # a profile of the user's own is none of ours
        return _profile_name(hyp)
    return "ci" if os.environ.get("CI") else "dev"
