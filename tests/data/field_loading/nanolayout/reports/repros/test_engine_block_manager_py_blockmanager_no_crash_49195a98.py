"""kvspec repro: NO_CRASH on target 'engine/block_manager.py:BlockManager'.

Admit(req='r1', prompt=(1, 2, 3, 4)) is valid here but the target raised AttributeError: Sequence has no 'num_new_tokens'

Found by: kvspec check --target engine/block_manager.py:BlockManager --max-examples 200 --seed 0 --json
1 steps, minimal: true.
Replays the steps on a fresh allocator and checks every invariant after each one.
Declaration: none: vLLM's defaults.
Runs from any directory: TARGET is loaded from RAN_IN; KVSPEC_TARGET=FILE.py:NAME names another target.
"""
import os

from kvspec.spec.ops import Admit
from kvspec.check.replay import replay

TARGET = 'engine/block_manager.py:BlockManager'
RAN_IN = ('../..', '/work/main/tests/data/field_loading/nanolayout')  # where kvspec check ran: from this file, and absolute
OP_TIMEOUT = 10.0  # seconds per target call it ran under (None: no limit)
CONFIG = {'level': 'cache', 'num_blocks': 1, 'block_size': 4, 'caching': True, 'kv_groups': 'full', 'max_model_len': None, 'spec_tokens': 0}
STEPS = [
    Admit(req='r1', prompt=(1, 2, 3, 4)),  # -> 0
]


def test_no_crash_violation():
    env = os.environ.get("KVSPEC_PATCH")
    replay(TARGET, CONFIG, STEPS, patch=None if env in (None, "", "none") else env, op_timeout=OP_TIMEOUT, origin=(__file__, RAN_IN))
