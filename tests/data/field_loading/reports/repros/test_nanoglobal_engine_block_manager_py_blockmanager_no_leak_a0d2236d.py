"""kvspec repro: NO_LEAK on target 'nanoglobal/engine/block_manager.py:BlockManager'.

Admit(req='r2', prompt=(1, 2, 3, 4, 11)) was refused although enough blocks were free or reclaimable

Found by: kvspec check --target nanoglobal/engine/block_manager.py:BlockManager --max-examples 200 --seed 0 --json
2 steps, minimal: true.
Replays the steps on a fresh allocator and checks every invariant after each one.
Declaration: none: vLLM's defaults.
Runs from any directory: TARGET is loaded from RAN_IN; KVSPEC_TARGET=FILE.py:NAME names another target.
"""
import os

from kvspec.spec.ops import Admit
from kvspec.check.replay import replay

TARGET = 'nanoglobal/engine/block_manager.py:BlockManager'
RAN_IN = ('../..', '/work/main/tests/data/field_loading')  # where kvspec check ran: from this file, and absolute
OP_TIMEOUT = 10.0  # seconds per target call it ran under (None: no limit)
CONFIG = {'level': 'cache', 'num_blocks': 2, 'block_size': 4, 'caching': True, 'kv_groups': 'full', 'max_model_len': None, 'spec_tokens': 0}
STEPS = [
    Admit(req='r1', prompt=(1, 2, 3, 4)),  # -> 0
    Admit(req='r2', prompt=(1, 2, 3, 4, 11)),  # -> 4
]


def test_no_leak_violation():
    env = os.environ.get("KVSPEC_PATCH")
    replay(TARGET, CONFIG, STEPS, patch=None if env in (None, "", "none") else env, op_timeout=OP_TIMEOUT, origin=(__file__, RAN_IN))
