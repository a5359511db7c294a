# Run: python tools/field_checkouts_confirm/<this file> (after python tools/field_checkouts.py --unpack puts the checkouts under /tmp/fc).
# jianzhnie/mini-vllm: can_append asks for a block when len(seq) % block_size == 0, may_append takes one
# when len(seq) % block_size == 1 (the scheduler calls both after the sampled token is appended).
import sys, types
root, pkg = "/tmp/fc/jianzhnie+mini-vllm", "minivllm"
sys.path.insert(0, root)
for name, path in ((pkg, f"{root}/{pkg}"), (f"{pkg}.engine", f"{root}/{pkg}/engine")):
    mod = types.ModuleType(name); mod.__path__ = [path]; sys.modules[name] = mod
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence
Sequence.block_size = 4
m = BlockManager(1, 4)
s = Sequence([1, 2, 3, 4])
m.allocate(s)
s.append_token(5)                         # len 5: position 4 needs a second block; the pool has none
print("can_append:", m.can_append(s))
try:
    m.may_append(s)
except Exception as e:
    print("may_append raised", type(e).__name__, e)

# ... and the other side: at len % block_size == 0 the token fits the last block (may_append only hashes it),
# yet can_append asks for a free block and refuses when the pool is empty.
m2 = BlockManager(1, 4)
s2 = Sequence([1, 2, 3])
m2.allocate(s2)
s2.append_token(4)                        # len 4: position 3 is in block 0, no new block needed
print("len 4, free blocks", len(m2._free_set), "-> can_append:", m2.can_append(s2))
