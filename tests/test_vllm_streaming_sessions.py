"""Streaming input sessions at the engine level, and the engine-level KV_INTEGRITY that
judges them (``kvspec.engine.kv_reads``).

vLLM #49449 (and #49377): a streaming session's next input keeps the session's tokens up
to its last sampled one and appends the new prompt, but ``Request.update_block_hashes``
only appends hashes, so a block that the discarded token had completed keeps the hash of
that token. The block is then cached under it holding the new token's KV, and a request
that resends the conversation as the client saw it (the discarded token included) hits
it and reads the wrong KV. Read in the release trees: ``_update_request_as_session``
from 0.15.0 to 0.31.0 keeps the stale hash; 0.32.0 drops the hashes past the kept tokens
(``del session.block_hashes[...]``).
"""
from __future__ import annotations

import pytest

from kvspec.engine.kv_reads import EngineKV
from kvspec.engine.protocol import StepFacts

from release_trees import OLD_POLICY, replay_on

ENGINE = dict(level="engine", num_blocks=12, block_size=4, caching=True, kv_groups="full", spec_tokens=0)
# the session stops after sampling 2, which completes block 0; its next input replaces it by 5;
# r2 resends the conversation as the client saw it: (11, 12, 13, 2), then a new token
STALE_HASH = ("[Arrive('r1', (11, 12, 13), 1, session=True), EngineStep(token=2), "
              "StreamInput('r1', (5, 6), 1), EngineStep(token=3), "
              "Arrive('r2', (11, 12, 13, 2, 14), 1), EngineStep(token=3)]")
# the control: r2 resends what the session holds now, (11, 12, 13, 5): a correct hit
SAME_CONTENT = STALE_HASH.replace("(11, 12, 13, 2, 14)", "(11, 12, 13, 5, 14)")


def _facts(**kw) -> StepFacts:
    return StepFacts(**{"scheduled": {}, **kw})


def test_a_read_of_a_slot_holding_other_tokens_kv_is_found():
    kv = EngineKV(block_size=2)
    kv.arrived("a", None)
    kv.arrived("b", None)
    # a computes tokens (1, 2) into block 3 (slots 6, 7)
    assert kv.step("s1", _facts(scheduled={"a": 2}, slots={"a": (6, 7)}, start={"a": 0}, tables={"a": (3,)}),
                   {"a": (1, 2)}) == []
    # b hits block 3 for a prefix (1, 2): the same KV
    assert kv.step("s2", _facts(scheduled={"b": 1}, slots={"b": (2,)}, start={"b": 2}, tables={"b": (3, 1)}),
                   {"b": (1, 2, 9)}) == []
    # c hits block 3 for (1, 5): block 3 holds (1, 2)'s KV
    kv.arrived("c", None)
    found = kv.step("s3", _facts(scheduled={"c": 1}, slots={"c": (2,)}, start={"c": 2}, tables={"c": (3, 1)}),
                    {"c": (1, 5, 9)})
    assert [v.invariant for v in found] == ["KV_INTEGRITY"] and "token 1" in found[0].message, found


def test_identity_drafts_and_external_loads():
    kv = EngineKV(block_size=2, loaded_externally=True)
    kv.arrived("a", "lora:A")
    kv.arrived("b", "lora:B")
    # a's step writes token 1 and a draft past its tokens (content unknown)
    kv.step("s1", _facts(scheduled={"a": 3}, slots={"a": (6, 7, 2)}, start={"a": 0}, tables={"a": (3, 1)}),
            {"a": (1, 2)})
    # b (another adapter) reads block 3 as its own prefix: other KV
    found = kv.step("s2", _facts(scheduled={"b": 1}, slots={"b": (0,)}, start={"b": 2}, tables={"b": (3, 0)}),
                    {"b": (1, 2, 4)})
    assert [v.invariant for v in found] == ["KV_INTEGRITY"] and "lora:A" in found[0].message
    # a draft's slot (2) and a slot no step wrote (block 5: a connector's load) are not judged
    kv.arrived("c", "lora:A")
    assert kv.step("s3", _facts(scheduled={"c": 1}, slots={"c": (4,)}, start={"c": 4}, tables={"c": (3, 1, 2)}),
                   {"c": (1, 2, 7, 8, 9)}) == []
    kv.arrived("d", None)
    assert kv.step("s4", _facts(scheduled={"d": 1}, slots={"d": (8,)}, start={"d": 2}, tables={"d": (5, 4)}),
                   {"d": (3, 3, 3)}) == []
    strict = EngineKV(block_size=2)
    strict.arrived("d", None)
    found = strict.step("s4", _facts(scheduled={"d": 1}, slots={"d": (8,)}, start={"d": 2}, tables={"d": (5, 4)}),
                        {"d": (3, 3, 3)})
    assert [v.invariant for v in found] == ["KV_INTEGRITY"] and "nothing this run wrote" in found[0].message


def test_a_connector_load_writes_the_prefix_it_serves():
    kv = EngineKV(block_size=2, loaded_externally=True)
    kv.arrived("a", None)
    kv.step("s1", _facts(scheduled={"a": 2}, slots={"a": (6, 7)}, start={"a": 0}, tables={"a": (3,)}), {"a": (1, 2)})
    # block 3 is reused by b, whose first two tokens the connector loads: not a's KV any more
    kv.arrived("b", None)
    facts = _facts(scheduled={"b": 1}, slots={"b": (2,)}, start={"b": 2}, tables={"b": (3, 1)}, loaded={"b": (0, 2)})
    assert kv.step("s2", facts, {"b": (5, 6, 7)}) == []
    # without the load, b would read a's KV in block 3
    kv.arrived("c", None)
    found = kv.step("s3", _facts(scheduled={"c": 1}, slots={"c": (4,)}, start={"c": 2}, tables={"c": (3, 2)}),
                    {"c": (1, 2, 7)})
    assert [v.invariant for v in found] == ["KV_INTEGRITY"] and "[5]" in found[0].message, found


@pytest.mark.slow
def test_a_streaming_update_keeps_a_stale_block_hash_on_0_22_0():
    got = replay_on("0.22.0", f"[('stale', {ENGINE!r}, {STALE_HASH}), ('same', {ENGINE!r}, {SAME_CONTENT})]",
                    OLD_POLICY)
    assert "streaming" in got["features"], got["features"]   # found by feature
    assert got["stale"] is not None, "0.22.0 served the KV of the session's new token under the stale hash? no: passed"
    index, invariant, message = got["stale"]
    assert (index, invariant) == (5, "KV_INTEGRITY") and "[11, 12, 13, 5]" in message, got["stale"]
    assert got["same"] is None, got["same"]   # resending what the block holds is a correct hit


# What the release sweep's engine pass found on 0.31.0 at its defaults (example 56 of seed 0,
# `tools/vllm_releases.py`): the session's turn ends on (23, 13, 12, 22, 4, 3, 3, 3); r2, a
# client that resent it, caches block [4, 3, 3, 3]; the session's next input keeps the turn
# but its last token and appends (1, 2, ...), so position 7 is now 1, but the session keeps
# the hash of [4, 3, 3, 3]; in a pool of 7 blocks it is preempted, and its re-admission looks
# that stale hash up and takes r2's block as its own position 7
FOUND_031 = ("[Arrive('r1', (23, 13, 12, 22), 4, session=True), EngineStep(token=4), "
             "EngineStep(token=3, drafts=2, accepted=1), EngineStep(token=3, drafts=2), "
             "Arrive('r2', (23, 13, 12, 22, 4, 3, 3, 3, 21), 3), EngineStep(token=3), "
             "StreamInput('r1', (1, 2, 4, 23, 4), 4), EngineStep(drafts=2, accepted=2), EngineStep(drafts=2), "
             "EngineStep(drafts=2, accepted=1)]")
FOUND_031_CONFIG = dict(level="engine", num_blocks=7, block_size=4, caching=True, kv_groups="full",
                        spec_tokens=2, spec_method="draft_model", connector="async;1,2,3,4")
# the same steps with the n-gram drafter and no connector (0.22.0 has no draft-model drafter);
# in a pool of 12 blocks nothing is preempted, and the session never looks the stale hash up
FOUND_NGRAM = dict(FOUND_031_CONFIG, spec_method="ngram", connector=None)
ROOMY = dict(FOUND_NGRAM, num_blocks=12)


def _read_own_stale_block(got, name: str) -> None:
    assert got[name] is not None, f"{name}: passed (the session never read the block its stale hash names)"
    index, invariant, message = got[name]
    assert (index, invariant) == (9, "KV_INTEGRITY"), got[name]
    assert "r1 reads token 7" in message and "[23, 13, 12, 22, 4, 3, 3, 3]" in message, message


@pytest.mark.slow
def test_the_sweeps_finding_replays_on_0_31_0():
    got = replay_on("0.31.0", f"[('found', {FOUND_031_CONFIG!r}, {FOUND_031})]")
    assert "lookahead:draft_model" in got["features"], got["features"]
    _read_own_stale_block(got, "found")


@pytest.mark.slow
def test_the_sweeps_finding_replays_on_0_22_0():
    got = replay_on("0.22.0", f"[('found', {FOUND_NGRAM!r}, {FOUND_031}), ('roomy', {ROOMY!r}, {FOUND_031})]",
                    OLD_POLICY)
    assert "streaming" in got["features"], got["features"]
    _read_own_stale_block(got, "found")
    assert got["roomy"] is None, got["roomy"]   # no preemption: the stale hash is never looked up


def _replay_on_installed(config, steps: str):
    pytest.importorskip("vllm")
    from kvspec.check.replay import replay_outcome
    from kvspec.spec.ops import Arrive, EngineStep, StreamInput  # noqa: F401 (the steps' names)
    from kvspec.vllm.inputs import features
    if "streaming" not in features():
        pytest.skip("the installed vLLM has no streaming input sessions")
    return replay_outcome("vllm", config, eval(steps), op_timeout=60.0)


@pytest.mark.upstream
def test_installed_vllm_keeps_no_stale_hash_across_a_preemption():
    out = _replay_on_installed(FOUND_NGRAM, FOUND_031)
    assert not out.failed, out.violations[0].message


@pytest.mark.upstream
def test_installed_vllm_drops_the_stale_hash():
    out = _replay_on_installed(ENGINE, STALE_HASH)
    assert not out.failed, out.violations[0].message
