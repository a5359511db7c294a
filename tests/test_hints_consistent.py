"""Issue 35 point 6(e): one run's hints never contradict each other. The walk saw a first
finding hinted "declare `whole_prompt_hits = true`" and the search under that assumption
hinted "declare `whole_prompt_hits = false`", the value the first finding failed under."""
from __future__ import annotations

from types import SimpleNamespace

from kvspec.check import hints
from kvspec.check.hints import Hint


def finding(invariant: str) -> SimpleNamespace:
    return SimpleNamespace(kind="violation", invariant=invariant, hints=[], label=None, disproved=None,
                           steps=[], config=None)


def test_a_hint_back_to_a_failed_value_is_dropped(monkeypatch):
    from kvspec.targets import load_target
    target = load_target("impl")
    target.traits = __import__("dataclasses").replace(target.traits, hintable=("whole_prompt_hits",))
    first, second = finding("MAX_HIT"), finding("KV_INTEGRITY")
    report = SimpleNamespace(violations=[first], assuming=[], examples=10, seconds=1.0, patch=None,
                             levels=["cache"], misuse=False, seed=0, budget=30.0)
    now = hints.policy_value(target.traits, "whole_prompt_hits")
    # the first finding passes only under the other value; the one found under that
    # assumption passes only under the value the first one failed under
    answers = {"MAX_HIT": [Hint("whole_prompt_hits", not now)], "KV_INTEGRITY": [Hint("whole_prompt_hits", now)]}
    monkeypatch.setattr(hints, "explain", lambda t, f: list(answers[f.invariant]))
    sub = SimpleNamespace(violations=[second], examples=5, seconds=1.0, error=None)
    runs = []
    monkeypatch.setattr("kvspec.check.search.run_check", lambda *a, **kw: runs.append(kw) or sub)
    hints.continue_search(target, "impl", report, {"max_examples": 20, "level": "cache"})
    said = {(h.key, h.value) for f in (first, second) for h in f.hints}
    assert ("whole_prompt_hits", True) in said or ("whole_prompt_hits", False) in said
    assert len({v for k, v in said if k == "whole_prompt_hits"}) == 1, said  # never both values
    assert second.label == "bug" and "no one whole_prompt_hits explains both" in second.disproved
    assert len(runs) == 1  # no second round assuming the value the first finding failed under


def test_another_value_of_an_open_key_is_kept():
    """Two free orders explain a finding and the first assumed was wrong: the next
    finding's hint naming a third order is no contradiction and stays."""
    f = finding("EVICTION_ORDER")
    f.hints = [Hint("free_order", "fifo")]
    hints.drop_contradictions([f], {"free_order": {"lru_tail_first", "mru"}})
    assert f.hints == [Hint("free_order", "fifo")] and f.label is None
