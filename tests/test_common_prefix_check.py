"""COMMON_PREFIX at the engine level: the common-prefix block count a scheduler reports
(what cascade attention reads once, from one request's table, for the whole batch) must
count blocks that every scheduled request holds at the same places.

The check reads ``StepFacts.common_prefix`` and ``StepFacts.group_tables``; these tests
hand it the facts of a step directly, so they run without any engine."""
from __future__ import annotations

from kvspec.engine.checks import _common_prefix
from kvspec.engine.protocol import StepFacts
from kvspec.spec.invariants import CATALOGUE, PRIORITY


def _v(inv, msg, rid, blocks=()):
    return (inv, msg, rid, tuple(blocks))


def _facts(counts, tables):
    return StepFacts(scheduled={r: 1 for r in tables}, common_prefix=counts, group_tables=tables)


def test_a_prefix_every_scheduled_request_holds_passes():
    assert _common_prefix(_facts((2,), {"r1": ((5, 6, 7),), "r2": ((5, 6, 9),)}), _v) == []


def test_a_block_one_scheduled_request_lacks_is_reported():
    # the ref-count rule counts r3's first block as shared because a request outside the batch
    # (a finished one whose free is deferred, a parked load) holds it
    found = _common_prefix(_facts((1,), {"r1": ((5, 6),), "r3": ((8, 9),)}), _v)
    assert [f[0] for f in found] == ["COMMON_PREFIX"]
    inv, msg, rid, blocks = found[0]
    assert "1 common-prefix blocks" in msg and set(blocks) == {5, 8}


def test_a_count_past_a_scheduled_tables_end_is_reported():
    found = _common_prefix(_facts((3,), {"r1": ((5, 6, 7),), "r2": ((5, 6),)}), _v)
    assert [f[0] for f in found] == ["COMMON_PREFIX"] and found[0][2] == "r2"


def test_each_group_is_checked_with_its_own_count():
    # group 0 agrees on one block; group 1 claims one block the two tables do not share
    ok = {"r1": ((5, 6), (11, 12)), "r2": ((5, 7), (11, 13))}
    assert _common_prefix(_facts((1, 1), ok), _v) == []
    bad = {"r1": ((5, 6), (11, 12)), "r2": ((5, 7), (14, 13))}
    found = _common_prefix(_facts((1, 1), bad), _v)
    assert len(found) == 1 and "group 1" in found[0][1]


def test_no_count_reported_checks_nothing():
    # 0.32.0 on: cascade attention is gone and the field is an empty, deprecated list
    assert _common_prefix(_facts((), {"r1": ((5,),), "r2": ((8,),)}), _v) == []
    assert _common_prefix(_facts((0,), {"r1": ((5,),), "r2": ((8,),)}), _v) == []


def test_the_invariant_is_catalogued():
    assert "COMMON_PREFIX" in CATALOGUE and "COMMON_PREFIX" in PRIORITY


# -- the draws that reach it: system-prompt batches ----------------------------------------
class _Data:
    """A stand-in for Hypothesis's ``data``: answers each label from a dict."""

    def __init__(self, answers):
        self.answers = answers

    def draw(self, strategy, label=None):
        return self.answers[label]


def test_a_system_prompt_example_prefixes_the_shared_block():
    from kvspec.engine.machine import _chunks, EngineMachine

    m = object.__new__(type("M", (EngineMachine,), {"system_prompt": True}))
    m.longest = 40
    system = tuple(_chunks()[0])
    assert m.new_prompt(_Data({"prompt": (21, 22), "system_prompt": True})) == system + (21, 22)
    assert m.new_prompt(_Data({"prompt": (21, 22), "system_prompt": False})) == (21, 22)
    plain = object.__new__(EngineMachine)
    plain.longest = 40
    assert plain.new_prompt(_Data({"prompt": (21, 22)})) == (21, 22)   # nothing more drawn


def test_odd_batches_from_the_fourth_draw_system_prompts_where_the_scheduler_reports_a_common_prefix(monkeypatch):
    import kvspec.vllm.inputs as inputs
    from kvspec.engine.inputs_machine import SYSTEM_PROMPT_BATCH, InputsEngineMachine

    monkeypatch.setattr(inputs, "features", lambda: frozenset({"cascade"}))
    picked = [b for b in range(12) if InputsEngineMachine.for_batch(b).system_prompt]
    assert picked == [b for b in range(SYSTEM_PROMPT_BATCH, 12, 2)] and SYSTEM_PROMPT_BATCH % 2 == 1
    assert issubclass(InputsEngineMachine.for_batch(SYSTEM_PROMPT_BATCH), InputsEngineMachine)
    monkeypatch.setattr(inputs, "features", lambda: frozenset())   # 0.32.0 on: no cascade attention
    assert not any(InputsEngineMachine.for_batch(b).system_prompt for b in range(12))
