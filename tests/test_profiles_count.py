"""Issue 35 point 1: a profile runs the number of examples it says, counted as
``kvspec check`` counts them (examples run, those Hypothesis discards part-way
included), and the deterministic profile (ci, --kvspec-max-examples) runs exactly what
``kvspec check --level L --max-examples N --seed S`` runs, so the corpus measurement
behind the ci count (reports/profiles.md) applies to it as measured."""
from __future__ import annotations

import pytest

from kvspec import pytest_plugin as plugin
from kvspec.check.profiles import PROFILES
from kvspec.pytest_plugin import BATCH, RunOptions, run_machine


@pytest.fixture(scope="module")
def impl():
    from kvspec.targets import load_target
    return load_target("impl")


def test_dev_profile_runs_its_count(impl, tmp_path):
    """dev is documented as PROFILES["dev"] examples; before, one Hypothesis run of that
    many kept examples ran about three times as many at the cache level."""
    n = PROFILES["dev"]["max_examples"]
    c = run_machine(impl, "impl", "cache", RunOptions(profile="dev", repro_dir=str(tmp_path),
                                                       database=str(tmp_path / "db")))
    # dev is random: the last batch asks for the share of what is left that Hypothesis kept
    # so far, and a run whose examples are discarded more often late (swarm examples with
    # features) may take one more batch; before, dev's 50 ran about 144
    assert n <= c["examples"] < n + 2 * BATCH, c["examples"]


def test_ci_profile_runs_what_kvspec_check_runs(impl, tmp_path, monkeypatch):
    """The ci profile at its count and seed draws kvspec check's examples at that level."""
    from kvspec.check.search import run_check
    monkeypatch.setitem(PROFILES["ci"], "max_examples", 40)  # the path ci takes, at a test's size
    for level in ("pool", "cache"):
        c = run_machine(impl, "impl", level, RunOptions(profile="ci", seed=3, repro_dir=str(tmp_path)))
        r = run_check(impl, "impl", level=level, seed=3, max_examples=40, report_dir=str(tmp_path))
        assert (c["examples"], c["steps"]) == (r.examples, r.steps), level
        assert c["stop"] == "40 examples"


def test_the_ci_profile_kills_reset_keeps_hashes(tmp_path):
    """The issue's 4-step bug (BlockPool.reset_prefix_cache keeps every block's hash): the
    ci profile's pool machine finds it (reports/profiles.md: 60-92 examples at seeds 0-2)."""
    pytest.importorskip("vllm", reason="the vllm target needs the vllm package")
    from pathlib import Path
    from kvspec.targets import load_target
    patch = str(Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "vllm" / "reset_keeps_hashes.diff")
    target = load_target("vllm", patch=patch)
    with pytest.raises(plugin.KvspecFailure) as e:
        run_machine(target, "vllm", "pool", RunOptions(profile="ci", repro_dir=str(tmp_path)), patch=patch)
    assert e.value.invariant == "INDEX_CONSISTENT"
