"""The cache level keeps to the engine's protocol (issue 21, item 4): after a refused
allocation the engine preempts the request (vLLM's scheduler) or leaves it waiting
(nano-vllm's), so no sequence kvspec draws holds a Step for a request whose last Step was
refused, until that request is preempted, finished or admitted again (or, with cache
features, its pending tokens are computed by a Prefill that succeeds: the scheduler's
retry after preempting another request).

Checked on the Hypothesis machine (plain and group-aware model, tiny pools so that
refusals are common) and on the model checker's enumeration; a control run with the old
rule (Step for every running request) shows the check can fail."""
from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import run_state_machine_as_test

from kvspec.mc.enumerate_ops import Bounds, enabled_cache_ops
from kvspec.spec.config import Config
from kvspec.spec.model import model_for
from kvspec.spec.ops import Admit, Finish, Prefill, Preempt, Step
from kvspec.stateful import cache_machine
from kvspec.targets.impl_target import ImplTarget

SETTINGS = settings(max_examples=150, stateful_step_count=30, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


def _target(features: bool) -> ImplTarget:
    t = ImplTarget()
    if not features:  # the plain one-group model (nano-vllm's and old vLLM's)
        t = copy.copy(t)
        t.traits = dataclasses.replace(t.traits, cache_features=False)
    return t


class Breach(AssertionError):
    """A Step drawn for a request whose last Step was refused."""


def _protocol_checker(base: type, log: dict) -> type:
    """``base`` with every op watched: a refused Step marks its request; Preempt, Finish,
    Admit and a Prefill that computes every pending token clear the mark; a Step for a
    marked request is a protocol breach, raised before the target sees it."""

    class Checked(base):
        def run(self, op):
            refused = self.__dict__.setdefault("refused", set())
            if isinstance(op, Step) and op.req in refused:
                log["breaches"].append(list(self.session.steps) + [op])
                raise Breach(f"Step after a refused Step: {self.session.steps + [op]}")
            super().run(op)
            if self.session is None:
                return
            q = self.m.reqs.get(op.req)
            pending = q is not None and q.running and q.computed < len(q.tokens)
            if isinstance(op, Step) and pending:
                refused.add(op.req)
                log["refusals"] += 1
            elif isinstance(op, (Preempt, Finish, Admit)) or (isinstance(op, Prefill) and not pending):
                refused.discard(op.req)

    Checked.__name__ = f"Protocol{base.__name__}"
    return Checked


def _run(features: bool, old_rule: bool = False) -> dict:
    log = {"breaches": [], "refusals": 0}
    base = cache_machine(_target(features), sizes=st.integers(2, 4))
    if old_rule:  # what the machine drew before: every running request could step
        base = type("OldRule", (base,), {"_steppable": lambda self: self.m.running()})
    run_state_machine_as_test(_protocol_checker(base, log), settings=SETTINGS)
    return log


@pytest.mark.parametrize("features", [False, True], ids=["plain_model", "group_model"])
def test_machine_never_steps_a_request_after_its_step_was_refused(features):
    log = _run(features)
    assert log["refusals"] > 0, "no Step was refused: the pools are too large to test the protocol"
    assert log["breaches"] == [], f"Step after a refused Step: {log['breaches'][0]}"


def test_the_old_rule_breaks_the_protocol():
    """Control: drawing Step for every running request (the old plain-model rule) is
    caught by the same checker, so the test above can fail."""
    with pytest.raises(Breach):
        _run(features=False, old_rule=True)


# -- the model checker's enumeration --------------------------------------------------
def _refused_state(features: bool):
    """A model whose request r1 has just had a Step refused: 3 usable blocks of 2, held by
    r1 (4 tokens) and r2 (2 tokens)."""
    t = _target(features)
    config = Config(level="cache", num_blocks=4, block_size=2)   # block 0 is the null block
    m = model_for(config, t.traits)
    m.apply(Admit("r1", (1, 2, 3, 4)))
    m.apply(Admit("r2", (11, 12)))
    assert m.reqs["r1"].running and m.reqs["r2"].running
    m.apply(Step("r1", 5))
    q = m.reqs["r1"]
    assert q.running and q.computed < len(q.tokens), "the Step was not refused"
    return m, config


@pytest.mark.parametrize("features", [False, True], ids=["plain_model", "group_model"])
def test_mc_enumeration_offers_no_step_after_a_refusal(features):
    m, config = _refused_state(features)
    ops = enabled_cache_ops(m, config, Bounds(), next_request=3)
    assert not [op for op in ops if isinstance(op, Step) and op.req == "r1"]
    assert Preempt("r1") in ops and Finish("r1") in ops
    assert any(isinstance(op, Step) and op.req == "r2" for op in ops)   # other requests still step
    m.apply(Preempt("r1"))
    m.apply(Finish("r2"))
    m.apply(Admit("r1"))   # re-admitted: its pending token is computed with the rest
    assert m.reqs["r1"].running and m.reqs["r1"].computed == len(m.reqs["r1"].tokens)
    assert any(isinstance(op, Step) and op.req == "r1" for op in enabled_cache_ops(m, config, Bounds(), next_request=3))
