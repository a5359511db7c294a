# Run: python tools/field_checkouts_confirm/<this file> (after python tools/field_checkouts.py --unpack puts the checkouts under /tmp/fc).
# AEM001/nano-vllm-1: allocate(seq, num_tokens) restarts the hash chain at h = -1 on every call, so a
# prefill in two chunks hashes the 2nd chunk's block like a first block and "hits" an unrelated block.
import sys, types
root, pkg = "/tmp/fc/AEM001+nano-vllm-1", "nanovllm"
sys.path.insert(0, root)
for name, path in ((pkg, f"{root}/{pkg}"), (f"{pkg}.engine", f"{root}/{pkg}/engine")):
    mod = types.ModuleType(name); mod.__path__ = [path]; sys.modules[name] = mod
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
Sequence.block_size = 4
m = BlockManager(4, 4)
s = Sequence([1, 2, 3, 4, 1, 2, 3, 4])
m.allocate(s, 4); s.num_cached_tokens = 4       # first chunk computed (the scheduler's postprocess does this)
m.allocate(s, 4)                                 # second chunk
print("table", s.block_table, "ref_counts", [m.blocks[b].ref_count for b in set(s.block_table)],
      "num_cached_tokens", s.num_cached_tokens)
