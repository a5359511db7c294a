# Run: python tools/field_checkouts_confirm/<this file> (after python tools/field_checkouts.py --unpack puts the checkouts under /tmp/fc).
# Wenyueh/MinivLLM: Block.reset() sets ref_count = 0, so a block in use has ref_count 0 and is never freed
import sys; sys.path.insert(0, "/tmp/fc/Wenyueh+MinivLLM/src")
from myvllm.engine.block_manager import BlockManager
from myvllm.engine.sequence import Sequence
Sequence.block_size = 4
m = BlockManager(4, 4)
s = Sequence(list(range(1, 6)))
m.allocate(s)
print("after allocate: table", s.block_table, "ref_counts", [m.blocks[b].ref_count for b in s.block_table])
m.deallocate(s)
print("after deallocate: free", len(m.free_block_ids), "of 4; ref_counts", [b.ref_count for b in m.blocks])
