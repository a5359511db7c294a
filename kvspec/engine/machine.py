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

Where the release has them (``kvspec.vllm.inputs.features``, by feature, on every
release the groups driver builds: 0.9.0 on), the machine also draws the inputs real
deployments send (issue 37; on a release the legacy engine drives, from the search's second
batch on: ``LegacyInputsEngineMachine``):
- a drafter with its own KV (``draft_model`` or ``eagle``) in half the drafted examples,
  so the scheduler reserves lookahead slots;
- the priority policy in a third of the examples, each arrival with a priority of 0 to 2;
- ``reset_prefix_cache`` mid-run in a third of the examples (``ResetPrefixCache``; half
  of them with ``reset_running_requests``, which preempts every running request);
- a KV connector in a quarter of the examples (full-attention groups only), serving one
  or two prefixes of one to three of the shared prompt chunks (``Config.connector``), half
  of them loading asynchronously where the release parks a loading request (with a rule
  that aborts a request while its load is in flight: a client gone mid-transfer);
- async scheduling (``Config.async_scheduling``: a step in flight while the next is
  scheduled) in half the examples, on an unpatched vLLM, without drafts (drawn first:
  such an example draws no drafts); three in four of them with the connector (a consumer:
  ``kv_both``), where the scheduler defers block frees behind the step in flight.
"""
from __future__ import annotations

from typing import Optional

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvspec.spec.config import Config
from kvspec.spec.ops import Abort, Arrive, EngineStep, ResetPrefixCache, StreamInput
from kvspec.stateful.base import KVMachine, RobustnessSink, machine_class_name
from kvspec.targets.base import Target

BLOCK_SIZE = 4
MAX_ARRIVED = 6        # requests per example
NUM_CHUNKS = 3
EXTRAS = (None, None, None, None, "salt:s", "salt:t")
# LoRA adapters, for an engine that takes them (its ``extra_kinds``): two adapters over the
# same prompts, and one with a salt too, so that blocks must differ by adapter
LORA_EXTRAS = ("lora:A", "lora:B", "lora:A;salt:s")
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

    def extras(self) -> tuple:
        """The extra keys an arrival may carry: cache salts (SpecEngineMachine: LoRA too)."""
        return EXTRAS

    @precondition(lambda self: len(self.arrived) < MAX_ARRIVED)
    @rule(data=st.data())
    def arrive(self, data):
        prompt = data.draw(_prompts(self.longest), label="prompt")
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


STREAMING = st.sampled_from((False, True, True, True))   # streaming examples, where the release has them
SAME_CLIENT = st.sampled_from((False, True, True, True))   # a follow-up turn keeps its conversation's extras


class InputsEngineMachine(SpecEngineMachine):
    """SpecEngineMachine plus the deployment inputs of the module doc, for a release on the
    current manager API (0.9.x keeps SpecEngineMachine: its rule list, and so its examples,
    stay as they were)."""

    def _inputs(self, data) -> dict:
        """The deployment inputs of this example (see the module doc): Config fields; sets
        ``self.resets`` (None: no resets drawn), ``self.priorities`` and ``self.streams``."""
        self.resets, self.priorities, self.streams = None, False, False
        self.sessions: dict[str, int] = {}     # streaming session -> its tokens when its turn ends
        self.seen: dict[str, list[tuple[int, ...]]] = {}   # request -> its sequences the engine held (follow-ups)
        self.turns: list[tuple[int, ...]] = []   # each paused session's conversation as its client saw it
        self.turn_of: dict[tuple[int, ...], str] = {}   # a turn -> its session
        self.extra_of: dict[str, Optional[str]] = {}   # request -> the extra keys it arrived with
        from kvspec.vllm.inputs import LOOKAHEAD_DRAFTERS, features
        have = features()
        out: dict = {}
        if "async" in have and not getattr(self.target, "patch_text", None) and \
                data.draw(st.booleans(), label="async_scheduling"):
            # a step in flight while the next is scheduled (vLLM's AsyncScheduler); drawn without
            # drafts (the engine's placeholder drafts are not driven) and on an unpatched vLLM only
            # (its AsyncScheduler subclasses the installed Scheduler)
            out["async_scheduling"] = True
            self.spec = 0
        drafters = [m for m in LOOKAHEAD_DRAFTERS if f"lookahead:{m}" in have]
        if self.spec and drafters:
            method = data.draw(st.sampled_from(["ngram"] * len(drafters) + drafters), label="spec_method")
            if method != "ngram":
                out["spec_method"] = method
        if "priority" in have and data.draw(st.sampled_from((False, False, True)), label="priority_policy"):
            out["policy"] = "priority"
            self.priorities = True
        if "reset" in have and data.draw(st.sampled_from((False, False, True)), label="resets"):
            self.resets = ("reset_preempt" in have)
        # streaming sessions (and follow-up prompts), drawn last so that the draws above stay as they were
        # in three examples of four without a step in flight (the engine-level KV reads need the
        # step's tables): a streaming example needs a session's turn, its next input, a step and
        # a second client's prompt in one example, so few of them find what only that order shows
        if "streaming" in have and not out.get("async_scheduling") and data.draw(STREAMING, label="streaming"):
            self.streams = True
        # the connector only over full attention: with a sliding-window group, vLLM frees the
        # out-of-window blocks of a finished request (remove_skipped_blocks) before the connector
        # sees it, a manager call the recorder does not report yet (reports/vllm-engine-inputs.md)
        if "connector" in have and (self.kv_groups or "full") == "full" and data.draw(
                st.sampled_from((False, True, True, True) if out.get("async_scheduling") else (False, False, False, True)),
                label="connector"):
            chunks = _chunks()
            prefix = st.integers(1, NUM_CHUNKS).flatmap(
                lambda k: st.lists(st.sampled_from(range(NUM_CHUNKS)), min_size=k, max_size=k))
            picked = data.draw(st.lists(prefix, min_size=1, max_size=2), label="remote_prefixes")
            out["connector"] = "|".join(",".join(str(t) for c in p for t in chunks[c]) for p in picked)
            if "connector_async" in have and data.draw(st.booleans(), label="connector_async"):
                from kvspec.vllm.connector import ASYNC
                out["connector"] = ASYNC + out["connector"]   # loads asynchronously (kvspec.vllm.connector)
        if self.resets and out.get("connector") and (out.get("async_scheduling") or out["connector"].startswith("async;")):
            # blocks a step in flight or a load still writes cannot be reset: vLLM's reset with
            # reset_running_requests raises "... not supported yet" there (read in 0.33.0), so such
            # an example resets without preempting (a refused reset is still checked: ACCOUNTING)
            self.resets = False
        return out

    def priority(self, data) -> int:
        return data.draw(st.integers(0, 2), label="priority") if self.priorities else 0

    # -- streaming sessions and follow-up prompts (where the release has them) -------------
    @precondition(lambda self: len(self.arrived) < MAX_ARRIVED)
    @rule(data=st.data())
    def arrive(self, data):
        """As EngineMachine's; in a streaming example, a session or a follow-up turn."""
        if getattr(self, "streams", False):
            self.arrive_session(data)
        else:
            EngineMachine.arrive(self, data)

    @precondition(lambda self: getattr(self, "streams", False) and len(self.arrived) < MAX_ARRIVED)
    @rule(data=st.data())
    def arrive_session(self, data):
        """A streaming session, or a follow-up turn: a prompt that resends one of a request's
        recent sequences, as a multi-turn client resends the conversation it saw (its last
        sampled token included), plus a new turn."""
        follow = bool(self.seen) and data.draw(st.booleans(), label="follow_up")
        owner = None
        if follow:
            if self.turns and data.draw(st.booleans(), label="a_whole_turn"):
                base = data.draw(st.sampled_from(self.turns[-3:]), label="resent")   # a turn as its client saw it
                owner = self.turn_of.get(base)
            else:
                owner = data.draw(st.sampled_from(sorted(self.seen)), label="conversation")
                base = data.draw(st.sampled_from(self.seen[owner][-3:]), label="resent")
            tail = data.draw(st.lists(st.sampled_from([t for c in _chunks() for t in c]), min_size=1,
                                      max_size=BLOCK_SIZE), label="new_turn")
            prompt = tuple(base) + tuple(tail)
        else:
            prompt = data.draw(_prompts(self.longest), label="prompt")
        prompt = prompt[: self.longest - 1]   # a session stays within the pool and any max_model_len cap
        # a turn that ends on a block boundary half the time: its last sampled token, which the
        # session's next input discards, then completes a block
        fits = [m for m in range(1, 5) if len(prompt) + m <= self.longest]
        edge = [m for m in fits if (len(prompt) + m) % BLOCK_SIZE == 0]
        max_tokens = data.draw(st.sampled_from(fits + edge * len(fits)), label="max_tokens")
        if owner is not None and data.draw(SAME_CLIENT, label="same_client"):
            # a conversation goes on under its own adapter and salt: only then can its resent
            # prefix hit the blocks it left (another identity must miss them, which arrive draws)
            extra = self.extra_of.get(owner)
        else:
            extra = data.draw(st.sampled_from(self.extras()), label="extra")   # salts and adapters, as arrive draws
        session = not follow
        rid = f"r{len(self.arrived) + 1}"
        self.arrived.append(rid)
        if session:
            self.sessions[rid] = len(prompt) + max_tokens
        self.run(Arrive(rid, prompt, max_tokens, extra, self.priority(data), session=session))

    @precondition(lambda self: bool(getattr(self, "sessions", None)))
    @rule(data=st.data())
    def stream_input(self, data):
        """A session's next input: it keeps its tokens but the last sampled one, then appends it."""
        self._stream(data.draw(st.sampled_from(sorted(self.sessions)), label="session"), data)

    def _stream(self, rid: str, data) -> None:
        kept = self.sessions[rid] - 1
        room = self.longest - kept
        if room < 2:
            return
        tokens = [t for c in _chunks() for t in c] + [1, 2, 3, 4]   # sampled tokens too: a client may resend them
        prompt = tuple(data.draw(st.lists(st.sampled_from(tokens), min_size=1, max_size=min(room - 1, BLOCK_SIZE + 1)),
                                 label="input"))
        fits = list(range(1, room - len(prompt) + 1))
        edge = [m for m in fits if (kept + len(prompt) + m) % BLOCK_SIZE == 0]   # as in arrive_session
        max_tokens = data.draw(st.sampled_from(fits + edge * len(fits)), label="max_tokens")
        self.sessions[rid] = kept + len(prompt) + max_tokens
        self.run(StreamInput(rid, prompt, max_tokens))

    def _answer_paused(self, data) -> None:
        """A streaming client sends its next input as soon as its session pauses, half the time
        (so the input does not wait on a rule that swarm testing may have turned off)."""
        paused = getattr(getattr(self.session, "engine", None), "paused", None)
        if not getattr(self, "streams", False) or not callable(paused):
            return
        tokens = self.session.engine.tokens()
        for rid in sorted(paused()):
            if tokens.get(rid) and tokens[rid] not in self.turns:
                self.turns.append(tokens[rid])   # the turn's last sampled token included
                self.turn_of[tokens[rid]] = rid
            if rid in self.sessions and data.draw(st.booleans(), label="next_input"):
                self._stream(rid, data)

    @rule(token=_TOKEN, data=st.data())
    def step(self, token, data):
        self.run(EngineStep(token=token))
        self._answer_paused(data)

    @rule(token=_TOKEN, data=st.data())
    def step_again(self, token, data):
        SpecEngineMachine.step_again(self, token, data)
        self._answer_paused(data)

    def run(self, op) -> None:
        if isinstance(op, Arrive) and hasattr(self, "extra_of"):
            self.extra_of[op.req] = op.extra
        super().run(op)
        if getattr(self, "streams", False) and isinstance(op, EngineStep) and self.session is not None:
            for rid, toks in self.session.engine.tokens().items():   # what a multi-turn client may resend:
                # the conversation as it saw it, a streaming session's last sampled token included
                mine = self.seen.setdefault(rid, [])
                if toks and toks not in mine:
                    mine.append(toks)

    def _loading(self) -> list:
        """The requests whose connector load is in flight (the engine's ``loading``), if any."""
        loading = getattr(getattr(self.session, "engine", None), "loading", None)
        return sorted(loading()) if callable(loading) else []

    @precondition(lambda self: bool(self._loading()))
    @rule(data=st.data())
    def abort_loading(self, data):   # a client gone while its KV is still arriving (P/D)
        self.run(Abort(data.draw(st.sampled_from(self._loading()), label="req")))

    @precondition(lambda self: getattr(self, "resets", None) is not None)
    @rule(data=st.data())
    def reset_prefix_cache(self, data):   # an operator's reset, mid-run (where the release has it)
        # not with streaming sessions: a paused session holds KV outside the running queue, which
        # vLLM's reset_running_requests does not preempt and then refuses with a RuntimeError that
        # says such requests are "not supported yet" (read in 0.22.0 and 0.33.0)
        preempt = bool(self.resets) and not self.streams and data.draw(st.booleans(), label="preempt_running")
        self.run(ResetPrefixCache(preempt))


class LegacyInputsEngineMachine(InputsEngineMachine):
    """InputsEngineMachine for a release the legacy engine drives (0.9.x to 0.30.x): the
    search's first batch (``for_batch(0)``, seeded as before) draws exactly what
    SpecEngineMachine drew there, with no deployment input, so the findings documented on
    those releases before the inputs were drawn keep their example counts (0.9.0's #19459 at
    example 11 of seed 0); every later batch draws the inputs. Each batch is seeded on its
    own (``kvspec.check.search``), so the later batches' examples do not depend on the first's."""

    @classmethod
    def for_batch(cls, batch: int) -> type:
        if batch > 0:
            return cls
        shared = {k: getattr(cls, k) for k in ("target", "misuse", "on_robustness", "counters", "kv_groups")}
        shared["excluded"] = getattr(cls, "excluded", frozenset())
        return type(cls.__name__, (SpecEngineMachine,), shared)


def engine_machine(target: Target, misuse: bool = False, on_robustness: Optional[RobustnessSink] = None,
                   kv_groups: Optional[str] = None) -> type:
    """A fresh EngineMachine subclass bound to ``target`` (its own example counters)."""
    from kvspec.engine.drivers import draws_deployment_inputs, legacy_engine_drives, supports_spec_decode
    attrs = dict(target=target, misuse=False, on_robustness=staticmethod(on_robustness) if on_robustness else None,
                 counters={"examples": 0, "steps": 0}, kv_groups=kv_groups)
    base = SpecEngineMachine if supports_spec_decode(target) else EngineMachine
    if base is SpecEngineMachine and draws_deployment_inputs(target):
        # the deployment inputs too; on a legacy-engine release, from the second batch on
        base = LegacyInputsEngineMachine if legacy_engine_drives(target) else InputsEngineMachine
    return type(machine_class_name("EngineMachine", target), (base,), attrs)
