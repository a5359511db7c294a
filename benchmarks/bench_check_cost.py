"""What checking costs: steps per second of a ``Session`` with every invariant on,
for pools of 8, 64, 1,024 and 16,384 blocks.

    python benchmarks/bench_check_cost.py [--steps 5000] [--windows 5] [--full-steps 200] [--profile] [--json]

Each checked step is what ``kvspec check`` does per step: ``Session.apply`` (the
target's op, the reference model's, the observation, every check of the catalogue)
on the ``impl`` target, in the session's default mode, as ``kvspec check`` uses it
(incremental checking from 64 blocks up; ``KVSPEC_INCREMENTAL`` unset). The ops are
``kvspec bench``'s fixed-seed pool-level trace (allocate 1-8 + cache, free tail
first, look up + touch a hit; about 75% occupancy) on a pool of that size.

Per pool size, a session and a bare driver (nothing checked) are first driven through
the same warm-up ops to the trace's working occupancy (untimed). Then windows of
``--steps`` ops are timed, round-robin over the pool sizes so that a change in the
machine's load hits every size alike (times are this process's CPU time,
``time.process_time``, so other processes' work is not counted): each window runs on the bare driver
(``unchecked``) and then on the session (``checked``); the table gives the medians,
and their difference is the cost of checking. Last, each session switches to the full
path (observe the whole pool and check every block after every step) for
``--full-steps`` more ops, for comparison. A violation anywhere is an error: the trace
is valid use of a correct allocator.

``--profile`` adds one more window at the largest pool under cProfile (not in the
table) and lists the functions with the most own time per step.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import math
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

# No sys.path change: kvspec is installed (pip install -e .). Putting the repository
# root on sys.path would also expose its top-level `kernels/` folder as a package named
# `kernels`, which transformers (imported by vLLM) probes for and would import.

from kvspec.targets.bench import build_trace  # noqa: E402
from kvspec.spec.config import Config  # noqa: E402
from kvspec.check.session import Session  # noqa: E402
from kvspec.targets import load_target  # noqa: E402

SIZES = (8, 64, 1024, 16384)
# CPU time of this process: the machine these numbers come from is shared, and wall
# clock time would count other processes' work (see reports/bench.md).
CLOCK = time.process_time


def warmup_ops(num_blocks: int) -> int:
    """Ops before the timed windows: enough to reach the trace's working occupancy."""
    return max(500, 3 * num_blocks)


class PoolRun:
    """One pool size: a session (checked) and a bare driver (unchecked) driven by the
    same trace, side by side; ``window()`` times the next ``steps`` ops on both."""

    def __init__(self, target, num_blocks: int, steps: int, windows: int, full_steps: int, seed: int = 0) -> None:
        self.n, self.steps = num_blocks, steps
        warm = warmup_ops(num_blocks)
        self.ops = build_trace(target, warm + steps * windows + full_steps, seed, num_blocks).ops
        cfg = Config(level="pool", num_blocks=num_blocks)
        self.session = s = Session(target, cfg)  # the default mode, as kvspec check uses it
        self.driver = target.driver(cfg)
        if s.initial:
            raise SystemExit(f"{num_blocks} blocks: violation at construction: {s.initial[0]}")
        self._apply(self.ops[:warm])
        for op in self.ops[:warm]:
            self.driver.apply(op)
        self.pos = warm
        self.checked: list[float] = []
        self.unchecked: list[float] = []

    def _apply(self, ops) -> None:
        for op in ops:
            found = self.session.apply(op)
            if found:
                raise SystemExit(f"{self.n} blocks: violation at {op!r}: {found[0]}")

    def window(self, profile: bool = False) -> None:
        ops = self.ops[self.pos:self.pos + self.steps]
        self.pos += len(ops)
        apply, check = self.driver.apply, self.session.apply
        t0 = CLOCK()
        for op in ops:
            apply(op)
        self.unchecked.append((CLOCK() - t0) / len(ops))
        prof = cProfile.Profile(CLOCK) if profile else None
        fast0 = self.session.fast_steps
        t0 = CLOCK()
        if prof:
            prof.enable()
        for op in ops:
            if check(op):
                raise SystemExit(f"{self.n} blocks: violation at {op!r}")
        if prof:
            prof.disable()
        sec = CLOCK() - t0
        self.fast = self.session.fast_steps - fast0
        if prof:
            st = pstats.Stats(prof)
            rows = sorted(((v[2], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in st.stats.items()), reverse=True)
            self.hotspots = {"blocks": self.n, "us_per_step_under_cprofile": round(sec / len(ops) * 1e6, 1),
                             "hotspots_us_per_step": [[name, round(t / len(ops) * 1e6, 2)] for t, name in rows[:12]]}
        else:
            self.checked.append(sec / len(ops))

    def full_path(self, steps: int) -> float:
        """Seconds per step on the full path (observe and check the whole pool), timed on
        the next ``steps`` ops: the session switches to it, as it does by itself after
        a step the incremental check cannot vouch for."""
        s = self.session
        if s.incremental:
            s.obs = s.obs  # materialize the observation the full path starts from
            s._live = None
            s.incremental = False
        ops = self.ops[self.pos:self.pos + steps]
        self.pos += len(ops)
        t0 = CLOCK()
        self._apply(ops)
        return (CLOCK() - t0) / len(ops)

    def row(self) -> dict:
        pool = self.session.driver.pool
        held = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        c, u = statistics.median(self.checked), statistics.median(self.unchecked)
        return {"blocks": self.n, "path": "incremental" if self.session.incremental else "full",
                "steps_per_window": self.steps, "windows": len(self.checked),
                "us_per_step": round(c * 1e6, 1), "steps_per_second": round(1 / c, 1),
                "us_per_step_windows": [round(x * 1e6, 1) for x in self.checked],
                "unchecked_us_per_step": round(u * 1e6, 2), "check_us_per_step": round((c - u) * 1e6, 1),
                "fast_steps_last_window": self.fast, "occupancy": round(held / (self.n - 1), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5_000, help="timed steps per window")
    ap.add_argument("--windows", type=int, default=5, help="windows per pool size, round-robin over the sizes")
    ap.add_argument("--full-steps", type=int, default=200, help="timed steps on the full path, per pool size")
    ap.add_argument("--full-max-blocks", type=int, default=16384, help="no full-path timing above this pool size")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true", help="one more, profiled window at the largest pool")
    ap.add_argument("--out", default=None, help="also write the JSON result to this file")
    ap.add_argument("--figure", default=None, help="also draw the table as a PNG here")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    target = load_target("impl")
    runs = [PoolRun(target, n, a.steps, a.windows + (1 if a.profile and n == max(sizes) else 0),
                    a.full_steps if n <= a.full_max_blocks else 0, a.seed) for n in sizes]
    for _ in range(a.windows):
        for r in runs:
            r.window()
    hot = None
    if a.profile:
        r = runs[sizes.index(max(sizes))]
        r.window(profile=True)
        hot = r.hotspots
    rows = [r.row() for r in runs]
    for r, row in zip(runs, rows):
        if r.n <= a.full_max_blocks:
            row["full_path_us_per_step"] = round(r.full_path(a.full_steps) * 1e6, 1)
    b = rows[0]
    for row in rows:
        row["cost_x"] = round(row["us_per_step"] / b["us_per_step"], 2)
        row["check_cost_x"] = round(row["check_us_per_step"] / b["check_us_per_step"], 2)
        row["log2_blocks_x"] = round(math.log2(row["blocks"]) / math.log2(b["blocks"]), 2)
    res = {"target": "impl", "level": "pool", "seed": a.seed, "steps_per_window": a.steps, "windows": a.windows,
           "python": platform.python_version(), "machine": platform.machine(), "rows": rows, "profile": hot}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    if a.figure:
        from kvspec.report.figures import check_cost_vs_pool_size
        check_cost_vs_pool_size(rows, a.figure)
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"median of {a.windows} windows of {a.steps:,} steps per size, round-robin over the sizes")
    print("| blocks | path | steps/s (checked) | us/step checked | us/step unchecked | us/step of checking | "
          f"checking x vs {b['blocks']:,} | log2(blocks) x | full path us/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['blocks']:,} | {row['path']} | {row['steps_per_second']:,.0f} | {row['us_per_step']} | "
              f"{row['unchecked_us_per_step']} | {row['check_us_per_step']} | {row['check_cost_x']} | "
              f"{row['log2_blocks_x']} | {row.get('full_path_us_per_step', '-')} |")
    if hot:
        print(f"\nhotspots at {hot['blocks']:,} blocks (one window under cProfile: {hot['us_per_step_under_cprofile']} "
              f"us/step), own time in us per step:")
        for name, us in hot["hotspots_us_per_step"]:
            print(f"  {us:8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
