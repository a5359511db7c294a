"""What one engine step did (``StepFacts``) and what an engine adapter offers (``EngineDriver``).

The shape is shared by every engine adapter (vLLM's Scheduler, nano-vllm's Scheduler) and
the engine-level checks; it is recorded in coord/INTERFACES.md. Facts are what the engine
*decided*; the checks compare them with what the KV manager then holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, runtime_checkable

from kvspec.spec.observation import Observation

# sample(req, position) -> the token the "model" samples at that position; deterministic.
Sampler = Callable[[str, int], int]


@dataclass(frozen=True)
class StepFacts:
    """One engine step, as the engine decided it."""
    scheduled: dict[str, int]                      # req -> tokens scheduled this step (prefill chunk, or 1 + drafts)
    preempted: tuple[str, ...] = ()                # preempted during this step's schedule()
    finished: tuple[str, ...] = ()                 # finished during this step's update (stop, length)
    # req -> slot ids (block_id * block_size + offset) of its scheduled tokens, when the engine says
    slots: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # req -> computed tokens before this step's schedule() (where the scheduled tokens start)
    start: dict[str, int] = field(default_factory=dict)
    # slots the scheduler must reserve past each request's scheduled tokens (a drafter's lookahead,
    # EAGLE / draft model), and req -> positions its table has room for right after schedule()
    lookahead: int = 0
    covered: dict[str, int] = field(default_factory=dict)
    cap: Optional[int] = None                      # max_model_len: no table needs room past it
    # under the priority policy: req -> the order preemption follows, (priority, arrival), the largest
    # preempted first, for every request running when the step was scheduled; empty: not checked
    rank: dict[str, tuple] = field(default_factory=dict)
    # req -> its table (group 0) right after schedule(), where the engine says: the slots the step's
    # attention reads (the engine-level KV_INTEGRITY, ``kvspec.engine.kv_reads``); empty: not checked
    tables: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # req -> (first position, count) of tokens whose KV a KV connector loaded when the request was
    # admitted this step (external computed tokens): their slots hold the KV of that prefix
    loaded: dict[str, tuple[int, int]] = field(default_factory=dict)
    # requests preempted inside this step's schedule() whose blocks did not return to the pool
    # (their free deferred behind a step in flight: vLLM's async scheduling with a consumer connector)
    unreclaimed: tuple[str, ...] = ()
    # the scheduler's common-prefix block count per KV-cache group (what cascade attention reads:
    # every request in the batch shares that many leading blocks), and req -> its table in every
    # group right after schedule(), for each scheduled request; empty: not reported, not checked
    common_prefix: tuple[int, ...] = ()
    group_tables: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)


@runtime_checkable
class EngineDriver(Protocol):
    """An engine whose own scheduler drives its own KV manager, seen from outside."""
    block_size: int
    num_blocks: int

    def arrive(self, req: str, prompt: tuple[int, ...], max_tokens: int, extra: Optional[str]) -> None:
        """A request arrives (``extra``: ';'-joined keys such as 'lora:NAME@PATH', 'salt:s', 'mm:X@2')."""

    def step(self, sample: Sampler, drafts: int, accepted: int) -> StepFacts:
        """schedule(), then the output update: each scheduled request that reached its end of prompt
        samples ``sample(req, pos)``; with spec decode ``drafts`` proposed, ``accepted`` kept."""

    def abort(self, req: str) -> None:
        """A client aborts the request (a no-op if it already finished)."""

    def observe(self) -> Observation:
        """The KV manager's state, normalized exactly as the cache level observes it."""

    def tables(self) -> dict[str, tuple[int, ...]]:
        """Live (not finished / aborted) request -> its block ids (group 0)."""

    def computed(self) -> dict[str, int]:
        """Live request -> its number of computed tokens."""

    def tokens(self) -> dict[str, tuple[int, ...]]:
        """Live request -> all its tokens (prompt + output)."""


@dataclass(frozen=True)
class ManagerCall:
    """One call the engine's scheduler made into its KV manager during the last engine
    event, as it was made (optional part of the protocol: ``EngineDriver.manager_calls``).

    The engine-level checker replays these through the cache-level reference model
    (``kvspec.engine.translate``), so the whole invariant catalogue runs on the engine's
    own sequence of allocations and frees, with the target's result and its state right
    after each call."""
    kind: str                      # "admit" (waiting -> running), "grow" (a running request), "verify"
                                   # (drafts checked, the kept ones cached), "preempt", "finish",
                                   # "publish" (hashes made visible, nothing allocated),
                                   # "reset" (reset_prefix_cache; ok: what it returned)
    req: str
    tokens: tuple[int, ...] = ()   # the request's tokens at the call (prompt + output)
    new: int = 0                   # tokens the call makes room for and computes now (verify: the
                                   # request's computed tokens after the update, which it caches up to)
    hit: int = 0                   # prefix-cache hit tokens (admit)
    external: int = 0              # tokens a connector supplies (admit)
    extra: Optional[str] = None    # the request's extra keys (admit)
    ok: bool = True                # the allocation succeeded
    whole: bool = False            # an admission gated on room for the whole sequence, not only this chunk
    drafts: tuple[int, ...] = ()   # grow: the draft tokens the request carries into the call
    accepted: int = 0              # verify: draft tokens kept ("verify" calls: the update after a drafted step)
    lookahead: int = 0             # admit / grow: slots asked for past the new tokens (a drafter's)
    obs: Optional[Observation] = None  # the KV manager right after the call
    # tokens of the request whose blocks the engine has published (hashed, indexed) right after
    # the call; None: every full computed block (the cache level's timing). "publish" calls
    # (hashes made visible by a call that allocates nothing, or in postprocess) carry it too.
    published: Optional[int] = None
