"""The deployment inputs on the releases that shipped the bugs (issue 37 part 3), each
through the release's own v1 Scheduler, from the cached release trees.

- EAGLE lookahead, 0.11.0 to 0.22.0 (read): the scheduler gives a request with no computed
  tokens (new, or resumed after preemption) no lookahead slots
  (``effective_lookahead_tokens = 0 if request.num_computed_tokens == 0``, from vLLM #20340
  until #43733), so EAGLE's drafter writes past the request's table. 0.14.0 fails SLOTS on
  the two events below; with the n-gram drafter (no lookahead) they pass, and on 0.27.0
  (``limit_lookahead_tokens = load_kv_async``) EAGLE passes too.
- a KV connector, 0.9.0 (read): aborting a request that is still waiting (it holds no
  blocks) asks ``KVCacheManager.get_block_ids``, which asserts the request is in
  ``req_to_blocks`` (vLLM #18829, fixed by #18485): AssertionError. Without a connector the
  same abort passes.

Without the release tree a case skips and says so (``release_trees``).
"""
from __future__ import annotations

import pytest

from release_trees import OLD_POLICY, replay_on as _run

EAGLE = dict(level="engine", num_blocks=9, block_size=4, caching=True, kv_groups="full", spec_tokens=2,
             spec_method="eagle")
# a 16-token prompt, four whole blocks: EAGLE's 2 lookahead slots need a fifth
LOOKAHEAD_STEPS = "[Arrive('r1', (1, 2, 3, 4, 11, 12, 13, 14, 1, 2, 3, 4, 23, 13, 1, 23), 9), EngineStep(token=4)]"
CONNECTOR = dict(level="engine", num_blocks=10, block_size=4, caching=True, kv_groups="full", spec_tokens=0,
                 connector="1,2,3,4,21,22,23,24")
ABORT_STEPS = "[Arrive('r1', (22, 4), 15), Abort('r1')]"


@pytest.mark.slow
def test_eagle_lookahead_not_reserved_for_a_new_request_on_0_14_0():
    got = _run("0.14.0", f"[('eagle', {EAGLE!r}, {LOOKAHEAD_STEPS}), "
                         f"('ngram', {dict(EAGLE, spec_method='ngram')!r}, {LOOKAHEAD_STEPS})]", OLD_POLICY)
    assert "lookahead:eagle" in got["features"], got["features"]   # found by feature on a release before 0.28
    assert got["eagle"] is not None, "0.14.0 reserved EAGLE's lookahead slots for a new request"
    index, invariant, message = got["eagle"]
    assert (index, invariant) == (1, "SLOTS") and "lookahead" in message and "not 18" in message, got["eagle"]
    assert got["ngram"] is None, got["ngram"]   # no drafter KV, no lookahead: the same events pass


@pytest.mark.slow
def test_eagle_lookahead_reserved_on_0_27_0():
    got = _run("0.27.0", f"[('eagle', {EAGLE!r}, {LOOKAHEAD_STEPS})]")
    assert "lookahead:eagle" in got["features"], got["features"]
    assert got["eagle"] is None, got["eagle"]   # #43733's scheduler reserves them: no finding


@pytest.mark.slow
def test_abort_of_a_waiting_request_with_a_connector_on_0_9_0():
    got = _run("0.9.0", f"[('connector', {CONNECTOR!r}, {ABORT_STEPS}), "
                        f"('no_connector', {dict(CONNECTOR, connector=None)!r}, {ABORT_STEPS})]", OLD_POLICY)
    assert "connector" in got["features"], got["features"]
    assert got["connector"] is not None, "0.9.0 aborted a waiting request under a connector without a crash"
    index, invariant, message = got["connector"]
    assert (index, invariant) == (1, "NO_CRASH") and "AssertionError" in message and "get_block_ids" in message, \
        got["connector"]
    assert got["no_connector"] is None, got["no_connector"]   # the abort alone is fine: the connector's path crashes


def test_a_legacy_engine_release_draws_the_inputs_after_its_first_batch(monkeypatch):
    """On a release the legacy engine drives, the search's first batch is SpecEngineMachine's
    (the draws of before: no reset rule, no input drawn), sharing the example counters and the
    excluded signatures; later batches draw the deployment inputs."""
    from kvspec.engine import drivers
    from kvspec.engine.inputs_machine import InputsEngineMachine, LegacyInputsEngineMachine
    from kvspec.engine.machine import SpecEngineMachine
    from kvspec.engine.machines import engine_machine
    from kvspec.targets.registry import load_target

    target = load_target("vllm")
    assert not issubclass(engine_machine(target), LegacyInputsEngineMachine)   # 0.33.0: the current engine
    monkeypatch.setattr(drivers, "legacy_engine_drives", lambda t: True)
    m = engine_machine(target)
    assert issubclass(m, LegacyInputsEngineMachine)
    m.excluded = frozenset({"NO_CRASH on Abort"})
    first = m.for_batch(0)
    assert issubclass(first, SpecEngineMachine) and not issubclass(first, InputsEngineMachine)
    assert not hasattr(first, "reset_prefix_cache")
    assert first.counters is m.counters and first.excluded == m.excluded and first.target is target
    assert m.for_batch(1) is m and m.for_batch(2) is m
