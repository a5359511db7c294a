"""The engine-level machine: the outside world's events only. Requests arrive (prompts
built from a few shared block-sized chunks, so prefix hits, chunked prefill and, in a
pool of 6 to 16 blocks, preemption all happen), the engine steps with a sampled token,
clients abort. What to schedule, chunk, preempt and finish is the engine's decision.

Only configurations the engine's own validation accepts are drawn: the block size is 4
(vLLM's CPU path rejects none of 1..16, but 4 keeps prompts a few blocks long), a prompt
never needs more blocks than the pool has, and ``max_tokens`` keeps every request within
the pool (and, unless a cap is drawn, within ``max_model_len``).

An engine with speculative decoding (vLLM's n-gram drafter) gets ``SpecEngineMachine``,
which draws its examples towards where scheduler bugs of preemption, speculative
decoding and prefix caching live together (vLLM 0.9.0's #19459 needs all three in one
example: an accepted draft carries a request across a block boundary, the next step
preempts it, and its re-admission looks up its cached prefix):

- speculative decoding in three examples of four (with 2 or 3 drafts per step);
- half the pools small (6 to 9 blocks), so a request's growth by 1 + drafts preempts;
- ``max_tokens`` up to 16, so a request decodes long enough to cross blocks while it
  is preempted and re-admitted;
- steps that propose drafts most of the time, and ``decode_run``: two to four drafted
  steps in a row, each keeping a drawn number of the drafts (accepted runs that grow
  requests across block boundaries while the pool fills).

Measured on vLLM 0.9.0 (``kvspec check --target vllm --level engine --max-examples 300``):
the old draws (spec decoding in one example of four, no runs) did not find #19459 within
3,000 examples at seeds 0-2; these find it at 14, 181 and 309 examples (seeds 0, 1, 2; the
last in the batch that crossed 300).
Engines without speculative decoding (nano-vllm) keep ``EngineMachine``'s draws as they were.
Where the KV manager preallocates blocks past a request's tokens (vLLM 0.8.4 and before, found
by feature), pools are drawn from 3 to 9 blocks, and from 3 to 5 with a lookahead drafter
(``PREALLOC_POOL``): there every admission takes the whole of a larger pool, so a scarce pool
is one the request's own tokens fill (how vLLM 0.8.4's H8, #16612, shows: at example 53 of
seed 0); no other release draws differently.

On the current manager API (vLLM >= 0.26) the machine also draws what a release can take
beyond salts: LoRA adapters (``extra_kinds``; two adapters over the same prompts, so blocks
must differ by adapter) and, in a quarter of the examples, a ``max_model_len`` of 8 to 24
tokens that binds (prompts stay under it, ``max_tokens`` may run past it: the scheduler
stops the request at the cap). 0.9.x's draws are unchanged, so its numbers above hold.

The deployment inputs a vLLM release has (connector, async scheduling, priority, resets,
streaming sessions, system prompts) are drawn by ``kvspec.engine.inputs_machine``.
"""
from __future__ import annotations

from typing import Optional

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvspec.spec.config import Config
from kvspec.spec.ops import Abort, Arrive, EngineStep
from kvspec.stateful.base import KVMachine

BLOCK_SIZE = 4
MAX_ARRIVED = 6        # requests per example
NUM_CHUNKS = 3
EXTRAS = (None, None, None, None, "salt:s", "salt:t")
# LoRA adapters, for an engine that takes them (its ``extra_kinds``): two adapters over the
# same prompts, and one with a salt too, so that blocks must differ by adapter
LORA_EXTRAS = ("lora:A", "lora:B", "lora:A;salt:s")
# in a system-prompt example, whether an arrival starts with the shared block: most do, and the
# few that do not are what a wrong common prefix (cascade attention's) would misread
SHARES_SYSTEM = st.sampled_from((True, True, True, False))
_TOKEN = st.integers(1, 4)          # few distinct sampled tokens: generated text shares prefixes too
_MAX_TOKENS = st.integers(1, 8)


def _chunks() -> list[list[int]]:
    return [[10 * c + i + 1 for i in range(BLOCK_SIZE)] for c in range(NUM_CHUNKS)]


def _prompts(max_len: int) -> st.SearchStrategy:
    chunks = _chunks()
    body = st.lists(st.sampled_from(chunks), min_size=0, max_size=3).map(lambda cs: [t for c in cs for t in c])
    tail = st.lists(st.sampled_from([t for c in chunks for t in c]), min_size=0, max_size=BLOCK_SIZE)
    return st.tuples(body, tail).map(lambda bt: tuple(bt[0] + bt[1])[:max_len]).filter(bool)


class EngineMachine(KVMachine):
    kv_groups: Optional[str] = None

    @initialize(data=st.data())
    def setup(self, data):
        n = data.draw(st.integers(6, 16), label="num_blocks")
        modes = getattr(self.target.traits, "caching_modes", (True, False))   # only what the engine can run
        caching = modes[0] if len(modes) == 1 else data.draw(st.sampled_from((True, True, True, False)),
                                                              label="caching")
        self.spec = 0   # no speculative decoding (SpecEngineMachine draws it)
        self.arrived: list[str] = []
        self.usable = (n - 1) * BLOCK_SIZE   # tokens the pool can hold for one request (null block aside)
        self.longest = self.usable - 1       # the longest prompt drawn
        self.start(Config(level="engine", num_blocks=n, block_size=BLOCK_SIZE, caching=caching,
                          kv_groups=self.kv_groups or "full", spec_tokens=self.spec))

    max_tokens = _MAX_TOKENS   # how long a request decodes (SpecEngineMachine: longer)
    system_prompt = False      # most prompts start with one shared block (SystemPromptMachine)

    def new_prompt(self, data) -> tuple[int, ...]:
        """A fresh prompt; in a system-prompt example, three in four start with the shared block."""
        prompt = data.draw(_prompts(self.longest), label="prompt")
        if self.system_prompt and data.draw(SHARES_SYSTEM, label="system_prompt"):
            prompt = (tuple(_chunks()[0]) + prompt)[: self.longest]
        return prompt

    def extras(self) -> tuple:
        """The extra keys an arrival may carry: cache salts (SpecEngineMachine: LoRA too)."""
        return EXTRAS

    @precondition(lambda self: len(self.arrived) < MAX_ARRIVED)
    @rule(data=st.data())
    def arrive(self, data):
        prompt = self.new_prompt(data)
        max_tokens = data.draw(self.max_tokens.filter(lambda m: len(prompt) + m <= self.usable), label="max_tokens")
        extra = data.draw(st.sampled_from(self.extras()), label="extra")
        priority = self.priority(data)
        rid = f"r{len(self.arrived) + 1}"
        self.arrived.append(rid)
        self.run(Arrive(rid, prompt, max_tokens, extra, priority))

    def priority(self, data) -> int:
        """An arrival's priority: 0 here, drawn where the priority policy runs
        (InputsEngineMachine); nothing is drawn, so this machine's draws stay as they were."""
        return 0

    @rule(token=_TOKEN)
    def step(self, token):
        self.run(EngineStep(token=token))

    @rule(token=_TOKEN, data=st.data())
    def step_again(self, token, data):  # a second rule: steps twice as likely as arrivals; drafts, when on
        drafts = data.draw(st.integers(0, self.spec), label="drafts") if self.spec else 0
        accepted = data.draw(st.integers(0, self.spec), label="accepted") if self.spec else 0
        self.run(EngineStep(token=token, drafts=drafts, accepted=accepted))

    @precondition(lambda self: bool(self.arrived) and self.session is not None
                  and getattr(self.session.engine, "native_abort", True) is not None)   # an engine without abort
    @rule(data=st.data())
    def abort(self, data):
        self.run(Abort(data.draw(st.sampled_from(self.arrived), label="req")))


# -- engines with speculative decoding (vLLM): see the module doc -----------------------
SPEC_TOKENS = (0, 2, 2, 3)          # draft tokens per step in an example (n-gram drafter); 0: off
SPEC_POOL = st.one_of(st.integers(6, 9), st.integers(6, 16))   # small pools half the time: preemption
# A manager that preallocates (vLLM 0.8.4 and before: up to 16 blocks past a request's tokens)
# hands every admitted request the whole of a 6-16 block pool, so there an admission meets a
# scarce pool (what a nearly full pool is in a deployment) only where the request's own tokens
# fill it: its pools are drawn from 3 blocks up, where a prompt of the drawn lengths does; with
# a drafter that reserves lookahead slots, from 3 to 5 blocks (in a larger pool the preallocated
# blocks always cover the slots, and whether the scheduler reserves them is never seen)
PREALLOC_POOL = st.integers(3, 9)
PREALLOC_LOOKAHEAD_POOL = st.integers(3, 5)
SPEC_MAX_TOKENS = st.integers(1, 16)
RUN_LENGTH = st.integers(2, 4)      # drafted steps in a row (decode_run)


def _drafts(spec: int) -> st.SearchStrategy:
    """Drafts a step proposes for the next one: mostly all of them, sometimes none."""
    return st.sampled_from((spec, spec, 0))


def _accepted(spec: int) -> st.SearchStrategy:
    """Of this step's drafts, how many the model keeps (0: all rejected)."""
    return st.integers(0, spec)


class SpecEngineMachine(EngineMachine):
    """The engine machine for an engine with speculative decoding (see the module doc)."""

    @initialize(data=st.data())
    def setup(self, data):
        from kvspec.engine.drivers import preallocating_manager
        prealloc = preallocating_manager(self.target)   # its pool is drawn after the drafter (see PREALLOC_POOL)
        n = 0 if prealloc else data.draw(SPEC_POOL, label="num_blocks")
        modes = getattr(self.target.traits, "caching_modes", (True, False))
        caching = modes[0] if len(modes) == 1 else data.draw(st.sampled_from((True, True, True, False)),
                                                              label="caching")
        self.spec = data.draw(st.sampled_from(SPEC_TOKENS), label="spec_tokens")
        inputs = None
        if prealloc:
            inputs = self._inputs(data)
            from kvspec.vllm.inputs import LOOKAHEAD_DRAFTERS
            n = data.draw(PREALLOC_LOOKAHEAD_POOL if inputs.get("spec_method") in LOOKAHEAD_DRAFTERS
                          else PREALLOC_POOL, label="num_blocks")
        self.arrived = []
        self.usable = (n - 1) * BLOCK_SIZE
        # a max_model_len that binds, in a quarter of the examples, where the manager takes one
        # (the current API; 0.9.x's draws stay as they were): requests then stop at the cap
        cap = None
        if getattr(self.target, "groups", False) and data.draw(st.sampled_from((False, False, False, True)),
                                                               label="capped"):
            cap = data.draw(st.integers(2 * BLOCK_SIZE, min(6 * BLOCK_SIZE, self.usable)), label="max_model_len")
        self.longest = (cap or self.usable) - 1
        if inputs is None:
            inputs = self._inputs(data)
        self.start(Config(level="engine", num_blocks=n, block_size=BLOCK_SIZE, caching=caching,
                          kv_groups=self.kv_groups or "full", spec_tokens=self.spec, max_model_len=cap, **inputs))

    def _inputs(self, data) -> dict:
        """Config fields of the deployment inputs an example draws (InputsEngineMachine)."""
        self.resets, self.priorities = None, False
        return {}

    max_tokens = SPEC_MAX_TOKENS

    def extras(self) -> tuple:
        kinds = getattr(getattr(self.session, "engine", None), "extra_kinds", ("salt",))
        return EXTRAS + (LORA_EXTRAS if "lora" in kinds else ())

    @rule(token=_TOKEN, data=st.data())
    def step_again(self, token, data):
        drafts = data.draw(_drafts(self.spec), label="drafts") if self.spec else 0
        accepted = data.draw(_accepted(self.spec), label="accepted") if self.spec else 0
        self.run(EngineStep(token=token, drafts=drafts, accepted=accepted))

    @precondition(lambda self: self.spec > 0 and bool(self.arrived))
    @rule(token=_TOKEN, data=st.data())
    def decode_run(self, token, data):   # consecutive drafted steps: each event is an EngineStep of its own
        for _ in range(data.draw(RUN_LENGTH, label="run")):
            self.run(EngineStep(token=token, drafts=self.spec,
                                accepted=data.draw(_accepted(self.spec), label="accepted")))
