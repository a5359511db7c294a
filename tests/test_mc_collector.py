"""kvspec.mc.collector: fewer cyclic collections during a search, put back afterwards."""
import gc

import pytest

from kvspec.mc import collector
from kvspec.mc.search import model_check
from kvspec.spec.config import Config
from kvspec.targets import load_target


@pytest.fixture
def thresholds():
    old = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*old)


def test_raised_inside_and_put_back_after(thresholds, monkeypatch):
    monkeypatch.delenv("KVSPEC_GC_THRESHOLD", raising=False)
    with collector.fewer_collections():
        inside = gc.get_threshold()
    assert inside[0] == collector.GEN0 and inside[1:] == (50, 100)
    assert gc.get_threshold() == (700, 10, 10)


def test_put_back_after_an_exception(thresholds):
    with pytest.raises(KeyError):
        with collector.fewer_collections():
            raise KeyError("x")
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("env,expected", [("0", 700), ("5000", 5000), ("junk", collector.GEN0), ("300", 700)])
def test_the_environment_sets_it_and_it_is_never_lowered(thresholds, monkeypatch, env, expected):
    monkeypatch.setenv("KVSPEC_GC_THRESHOLD", env)
    with collector.fewer_collections():
        assert gc.get_threshold()[0] == expected
    assert gc.get_threshold() == (700, 10, 10)


def test_a_search_runs_with_it_and_leaves_the_thresholds_as_they_were(thresholds, monkeypatch):
    monkeypatch.delenv("KVSPEC_GC_THRESHOLD", raising=False)
    from kvspec.check.session import ASK, Session
    during = set()
    real = Session.apply

    def apply(self, op, misuse=ASK):   # the thresholds while the search steps the target
        during.add(gc.get_threshold())
        return real(self, op, misuse)

    monkeypatch.setattr(Session, "apply", apply)
    r = model_check(load_target("impl"), Config(level="pool", num_blocks=4), 3)
    assert r.verdict == "pass" and r.states > 1
    assert during == {(collector.GEN0, 50, 100)}
    assert gc.get_threshold() == (700, 10, 10)
