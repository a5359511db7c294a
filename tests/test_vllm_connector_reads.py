"""Which slots a connector's load writes, on every release's allocate_slots form.

From 0.14.0 the scheduler passes a connector's tokens to ``allocate_slots`` as
``num_external_computed_tokens``; before, inside ``num_new_tokens``, where the engine
driver cannot tell them from a prefill. The engine-level KV reads (``kvspec.engine.kv_reads``)
must still know the load wrote them: otherwise a loaded block that last held another
prefix's KV (here r1's freed block, reused for r2's load in a pool of 3 usable blocks)
reads as that prefix's KV, a false KV_INTEGRITY (it showed as one on 0.11.1-0.13.0 in the
system-prompt batches, passing from 0.14.0: reports/vllm-history.md). The driver takes
the count from the connector's own answer to ``get_num_new_matched_tokens``.

Slow: each release imports its own vLLM in a subprocess (``tests/release_trees.py``).
"""
from __future__ import annotations

import pytest

from release_trees import OLD_POLICY, replay_on

REUSED = ("[('reused', dict(level='engine', num_blocks=4, block_size=4, caching=True, kv_groups='full', "
          "spec_tokens=0, connector='1,2,3,4,21,22,23,24'), "
          "[Arrive('r1', (31, 32, 33, 34, 35), 2), EngineStep(), EngineStep(), EngineStep(), "
          "Arrive('r2', (1, 2, 3, 4, 21, 22, 23, 24, 9), 3)] + [EngineStep()] * 4)]")


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.13.0", "0.14.0"])
def test_a_loaded_block_that_held_another_prefix_reads_as_loaded(version):
    got = replay_on(version, REUSED, OLD_POLICY)
    assert "connector" in got["features"], got["features"]
    assert got["reused"] is None, got["reused"]
