"""The misuses a scheduler can commit at the cache level (issue 13): admitting a running
request again (by id, or as a new request under its id), an empty prompt, stepping a
finished request and finishing one twice. impl rejects each with its documented class
and an unchanged state; an impl without the admission guard is caught, by one step list
and by the machine's misuse rules."""
from __future__ import annotations

import pytest

from kvspec.check.search import run_check
from kvspec.check.session import Session, run_steps
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Finish, Step
from kvspec.targets.impl_target import ImplTarget
from kvspec.stateful.cache import SchedulerMisuse, cache_machine

CACHE = Config(level="cache", num_blocks=8, block_size=2)
HYBRID = Config(level="cache", num_blocks=12, block_size=2, kv_groups="full,swa:2")
PROMPT = (1, 2, 3, 4, 5)

MISUSES = {
    "readmit_running": [Admit("r1", PROMPT), Admit("r1")],
    "running_as_new": [Admit("r1", PROMPT), Admit("r1", (7, 8, 9))],
    "empty_prompt": [Admit("r1", ())],
    "step_finished": [Admit("r1", PROMPT), Finish("r1"), Step("r1", 3)],
    "finish_twice": [Admit("r1", PROMPT), Finish("r1"), Finish("r1")],
}
GUARDED = ("readmit_running", "running_as_new", "empty_prompt")  # what check_admissible refuses


def _no_guard(monkeypatch) -> None:
    from kvspec.impl import hybrid_manager, kv_cache_manager
    for mod in (kv_cache_manager, hybrid_manager):
        monkeypatch.setattr(mod, "check_admissible", lambda request, held: None)


@pytest.mark.parametrize("config", [CACHE, HYBRID], ids=["one_group", "full_swa"])
@pytest.mark.parametrize("name", sorted(MISUSES))
def test_impl_rejects_the_misuse_cleanly(name, config):
    s = Session(ImplTarget(), config, incremental=False)
    *valid, misuse = MISUSES[name]
    for op in valid:
        assert s.apply(op) == []
    assert s.model.misuse_reason(misuse) is not None  # the model calls it a misuse
    before = s.driver.observe()
    assert s.apply(misuse) == []   # rejected with the documented class, state unchanged
    assert s.driver.observe() == before


@pytest.mark.parametrize("config", [CACHE, HYBRID], ids=["one_group", "full_swa"])
@pytest.mark.parametrize("name", GUARDED)
def test_an_impl_without_the_admission_guard_is_caught(monkeypatch, name, config):
    _no_guard(monkeypatch)
    out = run_steps(ImplTarget(), config, MISUSES[name])
    assert "ATOMIC_REJECT" in {v.invariant for v in out.violations}


def test_the_machine_draws_the_scheduler_misuses(monkeypatch, tmp_path):
    _no_guard(monkeypatch)
    rep = run_check(ImplTarget(), "impl", level="cache", misuse=True, seed=0, max_examples=200,
                    report_dir=str(tmp_path))
    found = [f for f in rep.violations + rep.robustness if f.invariant == "ATOMIC_REJECT"]
    assert found, rep.verdict
    messages = [v.message for f in found for v in f.violations]
    assert any(k in m for m in messages for k in ("is not waiting", "already exists", "empty prompt")), messages


def test_runs_without_misuse_do_not_draw_them():
    # A rule's mere presence changes Hypothesis's draws: valid-use runs must not see them.
    assert not issubclass(cache_machine(ImplTarget()), SchedulerMisuse)
    assert issubclass(cache_machine(ImplTarget(), misuse=True), SchedulerMisuse)
