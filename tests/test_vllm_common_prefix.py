"""COMMON_PREFIX on the releases that shipped the two ways a block looks shared by a batch
it is not (issue 37; reports/vllm-history.md H13, H14). The scheduler reports cascade
attention's common prefix by reference count: a block whose ``ref_cnt`` equals a count of
requests is taken to be held by every request of the batch.

- H13, vLLM #23130 (PR #23485): to 0.11.0 the count is ``len(self.running)``, so a request
  parked for its connector load (``WAITING_FOR_REMOTE_KVS``) that holds the block makes up
  for a running request that does not. Read: 0.9.0 and 0.11.0 report it; 0.11.1 counts the
  requests holding KV (``len(req_to_blocks)``) and passes.
- H14, vLLM #55227 (open): from 0.24.0, with async scheduling and a consumer connector, a
  request aborted with a step in flight leaves ``req_to_blocks`` while its blocks keep their
  references behind the fence (#45357), and makes up for a survivor that lacks the block.
  Read: 0.27.0 reports it; 0.23.0 (no fence) passes; without the connector (no fence) or
  without async scheduling the same events pass on 0.27.0.

Slow: each release imports its own vLLM in a subprocess (``tests/release_trees.py``).
"""
from __future__ import annotations

import pytest

from release_trees import OLD_POLICY, replay_on

# r1 and r3 run with different first blocks; r2 shares r1's first block (a prefix hit)
# and waits for the rest of its prompt from the connector, asynchronously
PARKED = ("[('parked', dict(level='engine', num_blocks=16, block_size=4, caching=True, kv_groups='full', "
          "spec_tokens=0, connector='async;1,2,3,4,9,10,11,12'), "
          "[Arrive('r1', (1, 2, 3, 4, 5, 6, 7, 8), 12), Arrive('r3', (21, 22, 23, 24, 25, 26, 27, 28), 12), "
          "EngineStep(token=1), EngineStep(token=1), Arrive('r2', (1, 2, 3, 4, 9, 10, 11, 12, 13), 4)] "
          "+ [EngineStep(token=1)] * 6)]")
# r2 shares r1's first block and is aborted with a step in flight
_ABORTED_STEPS = ("[Arrive('r1', (1, 2, 3, 4, 5, 6, 7, 8), 12), EngineStep(token=1), EngineStep(token=1), "
                  "Arrive('r2', (1, 2, 3, 4, 9, 10, 11, 12), 12), Arrive('r3', (21, 22, 23, 24, 25, 26, 27, 28), 12), "
                  "EngineStep(token=1), EngineStep(token=1), Abort('r2'), EngineStep(token=1), EngineStep(token=1)]")
_BASE = ("dict(level='engine', num_blocks=16, block_size=4, caching=True, kv_groups='full', spec_tokens=0, "
         "connector='91,92,93,94', async_scheduling=True)")
ABORTED = (f"[('fenced', {_BASE}, {_ABORTED_STEPS}), ('no_connector', dict({_BASE}, connector=None), {_ABORTED_STEPS}), "
           f"('not_async', dict({_BASE}, async_scheduling=False), {_ABORTED_STEPS})]")


def _prefix_finding(got) -> None:
    assert got is not None, "the scheduler's common prefix was never checked wrong"
    index, invariant, message = got
    assert invariant == "COMMON_PREFIX" and "r3" in message and "1 common-prefix blocks" in message, got


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.9.0", "0.11.0"])
def test_a_parked_load_makes_a_block_look_shared_to_0_11_0(version):
    _prefix_finding(replay_on(version, PARKED, OLD_POLICY)["parked"])


@pytest.mark.slow
def test_0_11_1_counts_the_requests_holding_kv():
    assert replay_on("0.11.1", PARKED, OLD_POLICY)["parked"] is None


@pytest.mark.slow
def test_an_aborted_request_behind_the_fence_makes_a_block_look_shared_on_0_27_0():
    got = replay_on("0.27.0", ABORTED)
    _prefix_finding(got["fenced"])
    assert got["no_connector"] is None and got["not_async"] is None, got


@pytest.mark.slow
def test_0_23_0_has_no_fence():
    assert replay_on("0.23.0", ABORTED, OLD_POLICY)["fenced"] is None
