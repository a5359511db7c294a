# Run: python tools/field_checkouts_confirm/<this file> (after python tools/field_checkouts.py --unpack puts the checkouts under /tmp/fc).
# AEM001/nano-vllm-1: a decode row is scheduled without its table growing (no may_append in schedule)
import sys, types; sys.path.insert(0, "/tmp/fc/AEM001+nano-vllm-1")
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
cfg = types.SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, eos=-1, chunk_size=64, long_prefill_threshold=512,
                            max_num_partial_prefills=4, max_long_partial_prefills=2, kvcache_block_size=4, num_kvcache_blocks=8)
s = Scheduler(cfg)
seq = Sequence(list(range(1, 9)), SamplingParams(max_tokens=4))
s.add(seq)
batch = s.schedule(); s.postprocess(list(batch), [7])       # prefill of 8 tokens, samples token 7
batch = s.schedule()                                          # decode: computes position 8
print("scheduled", [(q.seq_id, n) for q, n in batch], "len", len(seq), "table", seq.block_table,
      "-> position 8 needs block", 8 // 4, "but the table has", len(seq.block_table))
