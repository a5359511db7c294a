# Run: python tools/field_checkouts_confirm/<this file> (after python tools/field_checkouts.py --unpack puts the checkouts under /tmp/fc).
# tang-jiapeng/nano-vllm-v1: two blocks with the same hash released -> one block lost from every pool
import sys; sys.path.insert(0, "/tmp/fc/tang-jiapeng+nano-vllm-v1")
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
Sequence.block_size = 4
m = BlockManager(4, 4)
a, b = Sequence([1, 2, 3, 4]), Sequence([1, 2, 3, 4])
for s in (a, b):
    s.num_new_tokens = len(s) - s.num_cached_tokens
    m.allocate(s)
print("tables", a.block_table, b.block_table)
m.deallocate(a); m.deallocate(b)
pools = set(m.free_block_ids) | m.used_block_ids | set(m.cached_blocks.values())
print("blocks in no pool:", sorted(set(range(4)) - pools), "num_free_blocks", m.num_free_blocks, "of 4")
