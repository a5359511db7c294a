"""Decode tuning sweep on a CUDA GPU: the kernel's launch knobs (split count, key tile
width) timed side by side on the benchmark's decode shape, with a correctness check of
every variant against SDPA on the same gathered K/V. Run on the device machine:

    python benchmarks/tune_decode_gpu.py [--contexts 1024 4096 16384]
    python benchmarks/tune_decode_gpu.py --splits none --tiles none 64 --rounds 3   (A/B)

``none`` is the kernel's own choice. With ``--rounds R`` the variants run R times in
turn (interleaved, so drift hits every variant alike) and each row is the median of
its R medians, with the spread (max - min) beside it.

Prints one line per variant (median ms, GB/s, fraction of the copy bandwidth) and the
default's choice; nothing here changes the kernel. Without CUDA: one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels_gpu import DECODE, _bench, bytes_moved, copy_bandwidth_gbps, gathered, paged_inputs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--splits", nargs="+", default=["none", "1", "2", "4", "8"], help="split counts; none = default")
    p.add_argument("--tiles", nargs="+", default=["none", "32", "64", "128"], help="key tile widths; none = default")
    p.add_argument("--rounds", type=int, default=1, help="times each variant is timed, interleaved")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    knob = lambda v: None if v.lower() == "none" else int(v)  # noqa: E731
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
        variants = [(knob(s_), knob(t_)) for s_ in a.splits for t_ in a.tiles]
        times: dict = {v: [] for v in variants}
        errs: dict = {}
        for _ in range(a.rounds):
            for splits, tile in variants:
                if isinstance(errs.get((splits, tile)), str):  # failed once (did not compile): not retried
                    continue
                def run():
                    return paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"],
                                           num_splits=splits, tile_n=tile)
                try:
                    out = run()
                    errs[(splits, tile)] = (out.float() - ref).abs().max().item()
                    times[(splits, tile)].append(_bench(run))
                except Exception as e:  # a variant that does not compile (shared memory): say so, go on
                    errs[(splits, tile)] = f"{type(e).__name__}: {e}"[:200]
                    print(ctx, splits, tile, "error", errs[(splits, tile)])
        for splits, tile in variants:
            if not times[(splits, tile)]:
                rows.append({"context": ctx, "splits": splits, "tile_n": tile, "error": errs[(splits, tile)]})
                continue
            ms = statistics.median(times[(splits, tile)])
            spread = max(times[(splits, tile)]) - min(times[(splits, tile)])
            gbps = moved / (ms * 1e-3) / 1e9
            rows.append({"context": ctx, "splits": splits, "tile_n": tile, "ms": ms, "spread_ms": spread,
                         "rounds": len(times[(splits, tile)]), "gbps": gbps, "fraction_of_copy_bw": gbps / copy,
                         "max_abs_diff_vs_sdpa": errs[(splits, tile)]})
            print(f"ctx {ctx:6d} splits {str(splits):>4} tile {str(tile):>4}: {ms:.3f} ms (spread {spread:.3f}) "
                  f"{gbps:7.0f} GB/s ({gbps / copy:.2f}) diff {errs[(splits, tile)]:.2g}")
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
