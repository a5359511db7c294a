"""One run of a target against the reference model: apply an op to both, observe,
check every invariant. The stateful machines, the model checker, ``replay`` (repro
files) and the minimizer all drive targets through this class and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .config import Config
from .invariants import StepContext, check_step
from .model import CacheModel, model_for
from .observation import Observation
from .ops import Admit, Op
from .shadow import HashMap, ShadowKV
from .targets.base import Target
from .violation import Violation


class Session:
    def __init__(self, target: Target, config: Config) -> None:
        self.target = target
        self.config = config
        self.traits = target.traits
        self.driver = target.driver(config)
        self.model = model_for(config, self.traits)
        self.shadow = ShadowKV(config.block_size) if config.level == "cache" else None
        self.hashes = HashMap()
        self.steps: list[Op] = []
        self.last_result: Any = None  # what the target returned for the last op
        self.obs: Observation = self.driver.observe()
        self.initial: list[Violation] = check_step(self._context(None, self.obs, None, None, None, None))

    def _context(self, op, obs, misuse, error, result, expected) -> StepContext:
        return StepContext(op=op, config=self.config, traits=self.traits, prev=self.obs, obs=obs,
                           model=self.model, misuse=misuse, error=error, result=result, expected=expected,
                           shadow=self.shadow, hashes=self.hashes)

    @property
    def documents_misuse(self) -> bool:
        return bool(self.traits.misuse_errors)

    def misuse_reason(self, op: Op) -> Optional[str]:
        return self.model.misuse_reason(op)

    def apply(self, op: Op) -> list[Violation]:
        """Run ``op`` on target and model; return the violations it exposed (most specific first)."""
        misuse = self.model.misuse_reason(op)
        error: Optional[BaseException] = None
        result: Any = None
        try:
            result = self.driver.apply(op)
        except Exception as e:  # the target's own failure is a finding, not ours
            error = e
        expected = self.model.apply(op) if misuse is None else None
        try:
            obs = self.driver.observe()
        except Exception as e:
            if error is None:
                error = e
            obs = self.obs
        if self.shadow is not None and misuse is None and error is None:
            self._write_shadow(op, result, obs)
        found = check_step(self._context(op, obs, misuse, error, result, expected))
        self.steps.append(op)
        self.obs = obs
        self.last_result = result
        return found

    def _write_shadow(self, op: Op, result: Any, obs: Observation) -> None:
        """Record the KV the target just computed, at the slots its tables name."""
        assert isinstance(self.model, CacheModel)
        for rid, rs in obs.requests.items():
            q = self.model.reqs.get(rid)
            if q is None:
                continue
            before = self.obs.requests.get(rid)
            if isinstance(op, Admit) and op.req == rid and isinstance(result, int):
                start = result  # positions below the hit are read from the cache, not written
            elif before is not None:
                start = before.computed
            else:
                start = rs.computed
            self.shadow.write(rs.table, q.tokens, start, min(rs.computed, len(rs.table) * self.config.block_size,
                                                             len(q.tokens)))


@dataclass
class Outcome:
    """Where a step list first fails: ``index`` of the failing step (-1: at construction)."""
    index: Optional[int]
    violations: list[Violation] = field(default_factory=list)
    steps: list[Op] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.index is not None

    @property
    def invariant(self) -> Optional[str]:
        return self.violations[0].invariant if self.violations else None


def run_steps(target: Target, config: Config, steps: Sequence[Op]) -> Outcome:
    """Replay ``steps`` from a fresh allocator; stop at the first violation."""
    session = Session(target, config)
    if session.initial:
        return Outcome(-1, session.initial, [])
    for i, op in enumerate(steps):
        found = session.apply(op)
        if found:
            return Outcome(i, found, list(steps[: i + 1]))
    return Outcome(None, [], list(steps))
