"""``kvspec mc`` is bounded by construction and never loses what it reached (issue 22).

The caps are checked inside a state's expansion (a made-up clock or memory reading
makes the check come due mid-expansion, deterministically: no timing assertions); a
configuration whose one state cannot fit the memory cap is refused before anything
is built; a cap, a Ctrl-C or a SIGTERM ends the search with its partial counts, in
text and JSON; without ``--level`` the level the target supports is used.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from kvspec.cli import main
from kvspec.mc import budget as budget_mod
from kvspec.mc import search
from kvspec.mc.budget import Budget, state_bytes
from kvspec.mc.enumerate_ops import Bounds
from kvspec.spec.config import Config
from kvspec.targets.registry import load_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS = 30   # the initial state's expansion: alloc(1..30) and more, over 30 transitions


class Clock:
    """A clock that moves ``step`` seconds each time it is read."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class GrowingRss:
    """Resident memory that grows ``step`` bytes each time it is read."""

    def __init__(self, step: int) -> None:
        self.value, self.step = 100 * 2**20, step

    def __call__(self) -> int:
        self.value += self.step
        return self.value


def _pool(blocks: int = BLOCKS) -> Config:
    return Config(level="pool", num_blocks=blocks + 1, block_size=2)


def _ops_of_initial_state() -> int:
    """How many transitions the initial state's expansion has (depth 1, no cap)."""
    r = search.model_check(load_target("impl"), _pool(), 1, Bounds())
    assert r.verdict == "pass" and r.depth == 1
    return r.transitions


def test_time_cap_stops_inside_one_states_expansion():
    total = _ops_of_initial_state()
    b = Budget(time_cap=10.0, mem_cap_gib=2.0, num_blocks=BLOCKS + 1, clock=Clock(1.0))
    r = search.model_check(load_target("impl"), _pool(), 1, Bounds(), budget=b)
    assert r.verdict == "incomplete" and "time cap" in r.reason
    # stopped before the initial state's expansion was done: the check ran inside it
    assert 0 < r.transitions < total
    assert r.states >= 1 and r.depth == 0
    assert r.to_dict()["complete"] is False


def test_memory_cap_stops_inside_one_states_expansion():
    total = _ops_of_initial_state()
    b = Budget(time_cap=1e9, mem_cap_gib=0.01, num_blocks=BLOCKS + 1, clock=Clock(1.0), rss=GrowingRss(2**20))
    r = search.model_check(load_target("impl"), _pool(), 1, Bounds(), budget=b)
    assert r.verdict == "incomplete" and "memory cap" in r.reason
    assert 0 < r.transitions < total


def test_a_single_call_past_the_time_cap_is_interrupted(monkeypatch):
    # a driver whose construction never ends: only the watch thread can stop it
    monkeypatch.setattr(budget_mod, "GRACE_S", 0.0)
    monkeypatch.setattr(budget_mod, "WATCH_S", 0.02)
    real = search.Session

    class Slow(real):
        def __init__(self, *a, **kw):
            for _ in range(3000):   # 30 s unless interrupted
                time.sleep(0.01)
            super().__init__(*a, **kw)

    monkeypatch.setattr(search, "Session", Slow)
    r = search.model_check(load_target("impl"), _pool(3), 2, Bounds(), time_cap=0.2)
    assert r.verdict == "incomplete" and "time cap" in r.reason
    assert r.transitions == 0


def test_a_state_too_large_for_the_memory_cap_is_refused_before_building(monkeypatch, capsys):
    def never(*a, **kw):
        raise AssertionError("a session was built")

    monkeypatch.setattr(search, "Session", never)
    blocks = 10_000_000
    assert state_bytes(blocks) > 2**30
    assert main(["mc", "--blocks", str(blocks), "--mem-cap", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "one state of 10,000,000 blocks" in err and "--mem-cap" in err
    assert "Traceback" not in err and "internal error" not in err


def test_partial_json_on_a_cap(monkeypatch, capsys):
    # every read of the search's clock moves it a second: the 10 s cap comes due mid-expansion
    monkeypatch.setattr(search, "Budget", lambda t, m, n: Budget(t, m, n, clock=Clock(1.0)))
    code = main(["mc", "--blocks", str(BLOCKS), "--depth", "3", "--time-cap", "10", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0   # incomplete with nothing found: as before, not 1 (and never "pass")
    assert out["verdict"] == "incomplete" and out["complete"] is False
    assert "time cap of 10 s" in out["reason"]
    assert out["states"] >= 1 and out["transitions"] > 0 and out["depth"] == 0
    assert out["interrupted"] is None


def test_partial_text_on_a_cap(monkeypatch, capsys):
    monkeypatch.setattr(search, "Budget", lambda t, m, n: Budget(t, m, n, clock=Clock(1.0)))
    assert main(["mc", "--blocks", str(BLOCKS), "--depth", "3", "--time-cap", "10"]) == 0
    out = capsys.readouterr().out
    assert "kvspec mc: incomplete" in out and "time cap of 10 s" in out and "transitions" in out


def test_interrupt_mid_search_prints_partial_counts(monkeypatch, capsys):
    real_apply = search.Session.apply
    calls = []

    def apply(self, *a, **kw):
        calls.append(1)
        if len(calls) == 40:
            raise KeyboardInterrupt   # as a Ctrl-C lands: between two steps of the search
        return real_apply(self, *a, **kw)

    monkeypatch.setattr(search.Session, "apply", apply)
    code = main(["mc", "--blocks", "5", "--depth", "6", "--json"])
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert code == 130
    assert out["verdict"] == "incomplete" and out["interrupted"] == "SIGINT" and out["complete"] is False
    assert "interrupted (SIGINT)" in out["reason"]
    assert out["states"] > 1 and out["transitions"] >= 30
    assert "kvspec: interrupted" not in cap.err


def test_interrupt_propagates_from_the_library_call(monkeypatch):
    # without partial_on_interrupt (a test run, a script), a Ctrl-C still stops the caller
    def apply(self, *a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(search.Session, "apply", apply)
    with pytest.raises(KeyboardInterrupt):
        search.model_check(load_target("impl"), _pool(3), 2, Bounds())


def test_level_is_picked_for_a_cache_only_target(capsys):
    target = os.path.join(ROOT, "examples", "my_block_manager.py") + ":BlockManager"
    code = main(["mc", "--target", target, "--depth", "1", "--blocks", "3", "--json"])
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert code in (0, 1), cap.err
    assert out["level"] == "cache" and out["config"]["level"] == "cache"


def test_level_default_stays_pool_where_the_target_has_it(capsys):
    assert main(["mc", "--blocks", "2", "--depth", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["level"] == "pool"


def test_workers_beyond_the_cores_are_capped_with_a_note(monkeypatch, capsys):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert main(["mc", "--blocks", "2", "--depth", "1", "--workers", "8", "--json"]) == 0
    cap = capsys.readouterr()
    notes = [line for line in cap.err.splitlines() if "--workers 8" in line]
    assert len(notes) == 1 and "using 1" in notes[0]
    assert json.loads(cap.out)["workers"] == 1


@pytest.mark.skipif(sys.platform != "linux", reason="resident memory is read from /proc (Linux)")
def test_memory_reading_is_real():
    assert budget_mod.rss_bytes() > 0
