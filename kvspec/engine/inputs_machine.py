"""The engine-level machine with the inputs real deployments send (issue 37), for a vLLM
release that has them: ``SpecEngineMachine`` (``kvspec.engine.machine``) plus the draws below.

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
  ``kv_both``), where the scheduler defers block frees behind the step in flight;
- on a release whose scheduler reports cascade attention's common prefix ("cascade"), the
  search's odd batches from the fourth (``SYSTEM_PROMPT_BATCH``; 25 examples each, cut short by a
  finding) draw system-prompt examples: three
  prompts in four start with one shared block, as do a connector's remote prefixes, so a
  batch mostly shares a prefix, with a request outside it now and then (COMMON_PREFIX);
  three in four of them with a connector (as with async scheduling), three in four of those
  loading asynchronously: a P/D consumer, whose loads in flight hold the shared block.
"""
from __future__ import annotations

from typing import Optional

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvspec.engine.machine import (BLOCK_SIZE, MAX_ARRIVED, NUM_CHUNKS, EngineMachine, SpecEngineMachine, _chunks,
                                   _TOKEN)
from kvspec.spec.ops import Abort, Arrive, EngineStep, ResetPrefixCache, StreamInput

# the first batch that draws system-prompt examples where the release has cascade attention
# (then every other one). Batches 0-2 keep their examples; a finding ends its batch early, so
# on a release with findings batch 3 may start before example 75 (0.9.0's #32255 finding moved
# from example 68 to 122, measured: reports/vllm-history.md)
SYSTEM_PROMPT_BATCH = 3
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
                st.sampled_from((False, True, True, True) if out.get("async_scheduling") or self.system_prompt
                                else (False, False, False, True)), label="connector"):
            chunks = _chunks()
            prefix = st.integers(1, NUM_CHUNKS).flatmap(
                lambda k: st.lists(st.sampled_from(range(NUM_CHUNKS)), min_size=k, max_size=k))
            picked = data.draw(st.lists(prefix, min_size=1, max_size=2), label="remote_prefixes")
            if self.system_prompt:   # what a remote store holds starts with the deployment's system prompt
                picked = [[0] + p if p[0] != 0 else p for p in picked]
            out["connector"] = "|".join(",".join(str(t) for c in p for t in chunks[c]) for p in picked)
            # a system-prompt example is mostly a P/D consumer's (loads in flight hold the shared block)
            if "connector_async" in have and data.draw(st.sampled_from((False, True, True, True)) if self.system_prompt
                                                       else st.booleans(), label="connector_async"):
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

    @classmethod
    def for_batch(cls, batch: int) -> type:
        """The odd batches from ``SYSTEM_PROMPT_BATCH`` on (3, 5, 7, ...) of a release whose
        scheduler reports a common prefix for cascade attention draw system-prompt examples;
        the other batches, each seeded on its own, keep their examples."""
        if batch >= SYSTEM_PROMPT_BATCH and batch % 2 == 1:
            from kvspec.vllm.inputs import features
            if "cascade" in features():
                return type(cls.__name__, (cls,), {"system_prompt": True})   # the rest inherited
        return cls

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
            prompt = self.new_prompt(data)
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
            return super().for_batch(batch)
        shared = {k: getattr(cls, k) for k in ("target", "misuse", "on_robustness", "counters", "kv_groups")}
        shared["excluded"] = getattr(cls, "excluded", frozenset())
        return type(cls.__name__, (SpecEngineMachine,), shared)
