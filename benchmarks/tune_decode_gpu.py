"""Decode tuning sweep on a CUDA GPU: the kernel's launch knobs (split count, key tile
width) timed side by side on the benchmark's decode shape, with a correctness check of
every variant against SDPA on the same gathered K/V. Run on the device machine:

    python benchmarks/tune_decode_gpu.py [--contexts 1024 4096 16384]

Prints one line per variant (median ms, GB/s, fraction of the copy bandwidth) and the
default's choice; nothing here changes the kernel. Without CUDA: one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels_gpu import DECODE, _bench, bytes_moved, copy_bandwidth_gbps, gathered, paged_inputs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_decode_gpu: no CUDA device: nothing measured", file=sys.stderr)
        return 2
    import torch.nn.functional as F
    from kvspec.kernels import paged_attention

    copy = copy_bandwidth_gbps()
    rows = []
    for ctx in a.contexts:
        cfg = {**DECODE, "context": ctx}
        t = paged_inputs(cfg["batch"], ctx, cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"], cfg["block_size"], new=1)
        k, v = gathered(t, ctx)
        q4 = t["q"].view(cfg["batch"], cfg["q_heads"], 1, cfg["head_dim"])
        ref = F.scaled_dot_product_attention(q4, k, v, enable_gqa=True).view_as(t["q"]).float()
        moved = bytes_moved(t, ctx)
        for splits in (None, 1, 2, 4, 8):
            for tile in (None, 32, 64, 128):
                def run():
                    return paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"],
                                           num_splits=splits, tile_n=tile)
                try:
                    out = run()
                    err = (out.float() - ref).abs().max().item()
                    ms = _bench(run)
                except Exception as e:  # a variant that does not compile (shared memory): say so, go on
                    rows.append({"context": ctx, "splits": splits, "tile_n": tile, "error": f"{type(e).__name__}: {e}"[:200]})
                    print(ctx, splits, tile, "error", rows[-1]["error"])
                    continue
                gbps = moved / (ms * 1e-3) / 1e9
                rows.append({"context": ctx, "splits": splits, "tile_n": tile, "ms": ms, "gbps": gbps,
                             "fraction_of_copy_bw": gbps / copy, "max_abs_diff_vs_sdpa": err})
                print(f"ctx {ctx:6d} splits {str(splits):>4} tile {str(tile):>4}: {ms:.3f} ms {gbps:7.0f} GB/s "
                      f"({gbps / copy:.2f}) diff {err:.2g}")
    best = {}
    for r in rows:
        if "ms" in r and (r["context"] not in best or r["ms"] < best[r["context"]]["ms"]):
            best[r["context"]] = r
    print("copy GB/s", round(copy), "best:", json.dumps(best))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"copy_bandwidth_gbps": copy, "rows": rows, "best": best}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
