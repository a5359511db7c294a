"""Cache-level machine: requests are admitted (prefix lookup + allocation, or
refusal), decoded, preempted and finished, against any target.

Prompts are built from a few block-sized chunks plus occasional partial tails, so
shared prefixes, equal blocks behind different prefixes, full-prompt hits and
evictions all happen within a short run.
"""
from __future__ import annotations

from typing import Optional

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Finish, Preempt, Step
from kvspec.targets.base import Target

from kvspec.stateful.base import KVMachine, RobustnessSink

MAX_LIVE = 4   # requests alive at once
NUM_CHUNKS = 3


def chunk_tokens(block_size: int) -> list[list[int]]:
    """Chunk c is the block ``[10c+1, ..., 10c+block_size]``."""
    return [[10 * c + i + 1 for i in range(block_size)] for c in range(NUM_CHUNKS)]


def prompts(block_size: int) -> st.SearchStrategy:
    chunks = chunk_tokens(block_size)
    body = st.lists(st.sampled_from(chunks), min_size=0, max_size=3).map(lambda cs: [t for c in cs for t in c])
    tail = st.lists(st.sampled_from([t for c in chunks for t in c]), min_size=0, max_size=max(block_size - 1, 0))
    return st.tuples(body, tail).map(lambda bt: tuple(bt[0] + bt[1])).filter(bool)


class CacheMachine(KVMachine):
    sizes = st.integers(4, 12)
    block_sizes = st.integers(1, 4)

    @initialize(data=st.data())
    def setup(self, data):
        n = data.draw(self.sizes, label="num_blocks")
        lo = getattr(self.target.traits, "min_block_size", 1)  # below it: outside the target's contract
        bs = data.draw(self.block_sizes.filter(lambda b: b >= lo), label="block_size")
        self.next_id = 1
        self.start(Config(level="cache", num_blocks=n, block_size=bs))

    @property
    def m(self):
        return self.session.model

    @precondition(lambda self: self.session and len(self.m.reqs) < MAX_LIVE)
    @rule(data=st.data())
    def admit_new(self, data):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.run(Admit(rid, data.draw(prompts(self.session.config.block_size), label="prompt")))

    @precondition(lambda self: self.session and self.m.waiting())
    @rule(data=st.data())
    def admit_waiting(self, data):
        self.run(Admit(data.draw(st.sampled_from(self.m.waiting()), label="req")))

    @precondition(lambda self: self.session and self.m.running())
    @rule(data=st.data())
    def step(self, data):
        rid = data.draw(st.sampled_from(self.m.running()), label="req")
        tokens = [t for c in chunk_tokens(self.session.config.block_size) for t in c]
        self.run(Step(rid, data.draw(st.sampled_from(tokens), label="token")))

    @precondition(lambda self: self.session and self.m.running())
    @rule(data=st.data())
    def preempt(self, data):
        self.run(Preempt(data.draw(st.sampled_from(self.m.running()), label="req")))

    @precondition(lambda self: self.session and self.m.reqs)
    @rule(data=st.data())
    def finish(self, data):
        self.run(Finish(data.draw(st.sampled_from(sorted(self.m.reqs)), label="req")))

    # -- misuse ----------------------------------------------------------------------
    @precondition(lambda self: self.misuse and self.session is not None)
    @rule()
    def misuse_finish_unknown(self):
        self.run(Finish("ghost"))

    @precondition(lambda self: self.misuse and self.session and self.m.waiting())
    @rule(data=st.data())
    def misuse_preempt_waiting(self, data):
        self.run(Preempt(data.draw(st.sampled_from(self.m.waiting()), label="req")))


def cache_machine(target: Target, misuse: bool = False, on_robustness: Optional[RobustnessSink] = None,
                  sizes: Optional[st.SearchStrategy] = None) -> type[CacheMachine]:
    """A CacheMachine subclass bound to ``target``."""
    attrs = dict(target=target, misuse=misuse, on_robustness=staticmethod(on_robustness) if on_robustness else None,
                 counters={"examples": 0, "steps": 0})
    if sizes is not None:
        attrs["sizes"] = sizes
    return type(f"CacheMachine_{target.name}", (CacheMachine,), attrs)
