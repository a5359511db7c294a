"""impl's BlockPool against vLLM's, side by side, on `kvspec bench`'s trace.

    python benchmarks/bench_pools.py [--ops 200000] [--runs 15] [--seed 0] [--json]

The trace is ``kvspec.targets.bench``'s fixed-seed mixed pool-level trace (allocate 1-8 and
cache the request's full blocks, free a request tail first, look up a recent hash
and touch the hit; prefix caching on; about 75% of 1,023 usable blocks held). It is
resolved on each target (``kvspec.targets.bench.build_trace``); the two resolutions must be
the same op list, or the comparison stops.

Two measurements, both interleaved (impl, vllm, vllm, impl, ...: each round swaps
who goes first) and summarised by the median over the runs:

* ``direct``: the pools' own public methods, called with arguments prepared before
  the clock starts (block objects, hash values and, for vLLM's
  ``cache_full_blocks``, a real ``vllm.v1.request.Request`` carrying the block
  hashes); the timed loop is the same ``for fn, args in calls: fn(*args)`` for both,
  so it times the allocators and nothing else. This is the ratio the README quotes.
* ``driver``: what ``kvspec bench --target T`` times, the adapters' ``apply`` included
  (the vLLM adapter builds a Request per cache op, so this one favours impl).

Both are timed in this process's CPU time (``time.process_time``), which a shared
machine's other work does not inflate (``kvspec bench`` itself reports wall-clock time).

After every direct run the pool's final state (``observe_pool``) is compared with the
resolving run's, so both sides did exactly the trace's work.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

# No sys.path change: kvspec is installed (pip install -e .). Putting the repository
# root on sys.path would also expose its top-level `kernels/` folder as a package named
# `kernels`, which transformers (imported by vLLM) probes for and would import.

from kvspec.targets.bench import BENCH_BLOCKS, build_trace, time_trace  # noqa: E402
from kvspec.spec.ops import Alloc, Cache, Free, Lookup, Touch  # noqa: E402
from kvspec.targets import load_target  # noqa: E402
from kvspec.targets.impl_target import label_hash  # noqa: E402
from kvspec.targets.v1_driver import observe_pool  # noqa: E402

# CPU time of this process: on a shared machine wall-clock time counts other processes' work.
CLOCK = time.process_time
BLOCK_SIZE = 16  # vLLM's hash_block_size / block_size for the cache calls (any value: no tokens are hashed)


def _calls(pool, ops, cache_args, lookup_args) -> list:
    """[(bound method, args)] for a vLLM-v1-shaped pool: the pools differ only in the
    arguments of cache_full_blocks (``cache_args(k, blocks, labels)``) and
    get_cached_block (``lookup_args(label)``)."""
    blocks = pool.blocks
    calls = []
    for k, op in enumerate(ops):
        if isinstance(op, Alloc):
            calls.append((pool.get_new_blocks, (op.n,)))
        elif isinstance(op, Free):
            calls.append((pool.free_blocks, ([blocks[i] for i in op.blocks],)))
        elif isinstance(op, Touch):
            calls.append((pool.touch, ([blocks[i] for i in op.blocks],)))
        elif isinstance(op, Cache):
            calls.append((pool.cache_full_blocks, cache_args(k, [blocks[i] for i in op.blocks], op.hashes)))
        elif isinstance(op, Lookup):
            calls.append((pool.get_cached_block, lookup_args(op.hash)))
        else:
            raise TypeError(op)
    return calls


def impl_calls(ops, num_blocks: int):
    """(pool, [(bound method, args)]) for impl's BlockPool."""
    from kvspec import impl

    pool = impl.BlockPool(num_blocks, enable_caching=True)
    hashes: dict[str, bytes] = {}

    def h(label: str) -> bytes:
        if label not in hashes:
            hashes[label] = label_hash(label)
        return hashes[label]

    return pool, _calls(pool, ops, lambda k, bl, labels: (bl, [h(x) for x in labels], 0, len(bl)),
                        lambda label: (h(label),))


def vllm_calls(target, ops, num_blocks: int, requests: dict):
    """(pool, [(bound method, args)]) for vLLM's BlockPool, with upstream's own hashes.
    ``requests`` keeps the Request built for each cache op across runs (only its
    ``block_hashes`` are read)."""
    up = target.up
    pool = up.block_pool.BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE)

    def cache_args(k, bl, labels):
        req = requests.get(k)
        if req is None:
            req = requests[k] = up.new_request("bench", [0] * (BLOCK_SIZE * len(bl)))
            req.block_hashes = [up.label_hash(x, BLOCK_SIZE) for x in labels]
        return (req, bl, 0, len(bl), BLOCK_SIZE, 0)

    return pool, _calls(pool, ops, cache_args, lambda label: (up.label_hash(label, BLOCK_SIZE), [0]))


def run_calls(calls) -> float:
    gc.collect()
    gc.disable()
    try:
        t0 = CLOCK()
        for fn, args in calls:
            fn(*args)
        return CLOCK() - t0
    finally:
        gc.enable()


def _shape(obs):
    """The final state without hash values (the two pools hash labels differently)."""
    return ([(b.ref, b.hash is not None, b.queued) for b in obs.blocks], obs.queue, obs.free_count,
            sorted(len(v) for v in obs.index.values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=15, help="timed runs per target and mode (medians reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON result to this file")
    a = ap.parse_args()

    impl_t, vllm_t = load_target("impl"), load_target("vllm")
    import vllm

    tr_impl = build_trace(impl_t, a.ops, a.seed, BENCH_BLOCKS)
    tr_vllm = build_trace(vllm_t, a.ops, a.seed, BENCH_BLOCKS)
    if tr_impl.ops != tr_vllm.ops or _shape(tr_impl.final) != _shape(tr_vllm.final):
        print("the trace resolves differently on impl and vllm: no side-by-side comparison", file=sys.stderr)
        return 1
    ops, n = tr_impl.ops, BENCH_BLOCKS
    ref = _shape(tr_impl.final)
    requests: dict = {}

    times: dict[str, list[float]] = {"direct:impl": [], "direct:vllm": [], "driver:impl": [], "driver:vllm": []}
    builders = {"impl": lambda: impl_calls(ops, n), "vllm": lambda: vllm_calls(vllm_t, ops, n, requests)}
    targets = {"impl": (impl_t, tr_impl), "vllm": (vllm_t, tr_vllm)}
    for r in range(a.runs):
        order = ("impl", "vllm") if r % 2 == 0 else ("vllm", "impl")
        for name in order:
            pool, calls = builders[name]()
            times[f"direct:{name}"].append(run_calls(calls))
            if _shape(observe_pool(pool)) != ref:
                print(f"{name}: the direct run ended in another state than the resolving run", file=sys.stderr)
                return 1
            del pool, calls
        for name in order:
            t, tr = targets[name]
            times[f"driver:{name}"].append(time_trace(t, tr, clock=CLOCK))

    med = {k: statistics.median(v) for k, v in times.items()}
    ops_s = {k: len(ops) / v for k, v in med.items()}
    res = {
        "ops": len(ops), "mix": tr_impl.mix, "num_blocks": n, "seed": a.seed, "runs": a.runs,
        "vllm_version": getattr(vllm, "__version__", "?"), "python": platform.python_version(),
        "machine": platform.machine(),
        "ops_per_second": {k: round(v, 1) for k, v in ops_s.items()},
        "seconds_median": {k: round(v, 5) for k, v in med.items()},
        "seconds_min": {k: round(min(v), 5) for k, v in times.items()},
        "ratio_impl_over_vllm": {
            "direct": round(ops_s["direct:impl"] / ops_s["direct:vllm"], 3),
            "driver": round(ops_s["driver:impl"] / ops_s["driver:vllm"], 3),
        },
    }
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    if a.json:
        print(json.dumps(res))
    else:
        mix = ", ".join(f"{k} {v}" for k, v in sorted(res["mix"].items()))
        print(f"{len(ops)} ops ({mix}), {n} blocks, seed {a.seed}; medians of {a.runs} interleaved runs")
        print("| mode | impl ops/s | vllm ops/s | impl / vllm |")
        print("|---|---|---|---|")
        for mode in ("direct", "driver"):
            print(f"| {mode} | {ops_s[f'{mode}:impl']:,.0f} | {ops_s[f'{mode}:vllm']:,.0f} | "
                  f"{res['ratio_impl_over_vllm'][mode]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
