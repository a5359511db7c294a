"""GPU benchmark of the paged-attention kernel (issue 5). Needs a CUDA GPU.

    python benchmarks/bench_kernels_gpu.py [--out-dir reports] [--quick]

In one run it measures:
  * the device's copy bandwidth (a large device-to-device copy: bytes read + written);
  * decode: bf16, batch 64, context 4096, 32 query / 8 KV heads, head_dim 128,
    block_size 16, over a shuffled block table. Achieved bandwidth counts the K/V
    bytes the kernel must read (plus q, out and the block table), reported as a
    fraction of the copy bandwidth, and the time against torch SDPA on the same K/V
    gathered into contiguous tensors (the gather is done before timing);
  * extend: 2048 cached tokens + 512 new per sequence (batch 8), against SDPA with
    the equivalent bottom-right causal mask;
  * bandwidth against context length for the decode shape (the plot).
Times come from ``triton.testing.do_bench`` (median ms, L2 flushed between runs).
Writes ``reports/kernels.json`` and ``reports/kernels_bandwidth.png``. Without CUDA
it prints one line and exits 2 without writing anything.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DECODE = dict(batch=64, context=4096, q_heads=32, kv_heads=8, head_dim=128, block_size=16)
EXTEND = dict(batch=8, prefix=2048, new=512, q_heads=32, kv_heads=8, head_dim=128, block_size=16)
CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384)


def _bench(fn) -> float:
    """Median milliseconds of ``fn`` over repeated CUDA runs (event-timed, L2 flushed)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth_gbps() -> float:
    """Device copy bandwidth: 2 x bytes (read and write) of a 1 GiB copy, per second."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


def paged_inputs(batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
                 new: int, dtype=torch.bfloat16, seed: int = 0) -> dict[str, Any]:
    """Caches with exactly the blocks the batch needs, handed out in a shuffled order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-context // block_size)
    num_blocks = batch * pages
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    tables = perm.view(batch, pages).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * new, q_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device="cuda") if new > 1 else None
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=seq_lens, cu=cu)


def gathered(t: dict[str, Any], context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as contiguous [batch, kv_heads, context, head_dim] (the SDPA baseline's input)."""
    def one(cache: torch.Tensor) -> torch.Tensor:
        b = t["block_tables"].shape[0]
        x = cache[t["block_tables"].long()]  # [batch, pages, block_size, kv_heads, dim]
        return x.reshape(b, -1, *cache.shape[2:])[:, :context].transpose(1, 2).contiguous()
    return one(t["k_cache"]), one(t["v_cache"])


def bytes_moved(t: dict[str, Any], context: int) -> int:
    """What the kernel has to move at least: K and V of every token, q, out, the tables."""
    b, kvh, d = t["block_tables"].shape[0], t["k_cache"].shape[2], t["k_cache"].shape[3]
    kv = 2 * b * context * kvh * d * t["k_cache"].element_size()
    return kv + 2 * t["q"].numel() * t["q"].element_size() + t["block_tables"].numel() * 4


def bench_decode(cfg: dict, copy_gbps: float, with_sdpa: bool = True) -> dict[str, Any]:
    import torch.nn.functional as F

    from kvspec.kernels import paged_attention

    t = paged_inputs(cfg["batch"], cfg["context"], cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"],
                     cfg["block_size"], new=1)
    ms = _bench(lambda: paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"]))
    gbps = bytes_moved(t, cfg["context"]) / (ms * 1e-3) / 1e9
    row: dict[str, Any] = {**cfg, "dtype": "bfloat16", "ms": ms, "gbps": gbps, "fraction_of_copy_bw": gbps / copy_gbps}
    if with_sdpa:
        k, v = gathered(t, cfg["context"])  # gather time excluded: done here, before timing
        q4 = t["q"].view(cfg["batch"], cfg["q_heads"], 1, cfg["head_dim"])
        sdpa_ms = _bench(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
        row.update(sdpa_ms=sdpa_ms, speedup_vs_sdpa=sdpa_ms / ms)
        out = paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"])
        ref = F.scaled_dot_product_attention(q4, k, v, enable_gqa=True).view_as(out)
        row["max_abs_diff_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
    return row


def bench_extend(cfg: dict, copy_gbps: float) -> dict[str, Any]:
    import torch.nn.functional as F

    from kvspec.kernels import paged_attention

    ctx = cfg["prefix"] + cfg["new"]
    t = paged_inputs(cfg["batch"], ctx, cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"], cfg["block_size"],
                     new=cfg["new"])
    run = lambda: paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"],  # noqa: E731
                                  cu_seqlens_q=t["cu"])
    ms = _bench(run)
    # Causal FLOPs: each new token i (0-based) sees prefix + i + 1 keys; QK^T and PV, 2 flops per MAC.
    keys = cfg["batch"] * sum(cfg["prefix"] + i + 1 for i in range(cfg["new"]))
    flops = 4 * keys * cfg["q_heads"] * cfg["head_dim"]
    k, v = gathered(t, ctx)
    q4 = t["q"].view(cfg["batch"], cfg["new"], cfg["q_heads"], cfg["head_dim"]).transpose(1, 2)
    mask = torch.ones(cfg["new"], ctx, dtype=torch.bool, device="cuda").tril(diagonal=cfg["prefix"])
    sdpa_ms = _bench(lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=True))
    out = run()
    ref = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).reshape_as(out)
    return {**cfg, "dtype": "bfloat16", "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
            "gbps": bytes_moved(t, ctx) / (ms * 1e-3) / 1e9, "sdpa_ms": sdpa_ms, "speedup_vs_sdpa": sdpa_ms / ms,
            "max_abs_diff_vs_sdpa": (out.float() - ref.float()).abs().max().item()}


def run_benchmark(out_dir: Path | str = ROOT / "reports", quick: bool = False) -> dict[str, Any]:
    """Measure everything, write ``kernels.json`` and the plot under ``out_dir``, return the dict."""
    if not torch.cuda.is_available():
        return {"skipped": f"no CUDA device (torch {torch.__version__} sees none): nothing measured"}
    start = time.perf_counter()
    copy_gbps = copy_bandwidth_gbps()
    decode = bench_decode(DECODE, copy_gbps)
    extend = bench_extend(EXTEND, copy_gbps)
    curve = [bench_decode({**DECODE, "context": c}, copy_gbps, with_sdpa=False)
             for c in (CONTEXTS[:4] if quick else CONTEXTS)]
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "copy_bandwidth_gbps": copy_gbps,
        "decode": decode,
        "extend": extend,
        "bandwidth_vs_context": [{"context": r["context"], "gbps": r["gbps"], "ms": r["ms"],
                                  "fraction_of_copy_bw": r["fraction_of_copy_bw"], "label": "paged decode bf16"}
                                 for r in curve],
        "goal": "decode >= 0.80 of measured copy bandwidth",
        "goal_met": decode["fraction_of_copy_bw"] >= 0.80,
        "seconds": round(time.perf_counter() - start, 1),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(res, indent=2) + "\n")
    try:
        from kvspec.report.figures import bandwidth_vs_context

        bandwidth_vs_context(res["bandwidth_vs_context"], out / "kernels_bandwidth.png",
                             title=f"paged decode, bf16, batch 64, 32/8 heads, d 128, bs 16 ({res['device']})",
                             peak_gbps=copy_gbps)
        res["plot"] = str(out / "kernels_bandwidth.png")
    except Exception as e:  # the numbers matter more than the picture
        res["plot_error"] = f"{type(e).__name__}: {e}"
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=str(ROOT / "reports"))
    p.add_argument("--quick", action="store_true", help="fewer context lengths on the curve")
    a = p.parse_args(argv)
    res = run_benchmark(a.out_dir, quick=a.quick)
    if "skipped" in res:
        print(f"bench_kernels_gpu: {res['skipped']}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
