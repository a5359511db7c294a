"""Which adapter fell behind: each target's `kvspec bench` speed as a ratio to impl's, in
one run, against the ratios of the figures committed in reports/bench.md.

    python benchmarks/bench_adapters.py [--targets impl,vllm] [--ops 200000] [--rounds 5]
                                        [--guard-share] [--tolerance 0.15] [--json] [--out FILE]

Absolute ops/s move with the machine (a shared 2-core VM gives 0.6-1.0x of a quiet one),
so the only stable figure is the ratio to impl measured in the same process minutes: each
round runs every target's replay once, in an order that rotates per round, and the
medians of the rounds' CPU-time ops/s are compared. The committed reference is the pair
of `$ kvspec bench [--target T] --json` lines in reports/bench.md (their
``cpu_ops_per_second``); a target whose ratio to impl is more than ``--tolerance`` below
the committed ratio is named as fallen behind, and the exit status is 1.

``--guard-share`` also times impl with its per-block ownership guard
(``BlockPool._check_own``: a block of another pool, or the null block, is refused
before anything changes) replaced by a no-op, interleaved with the real one, and reports
the guard's share of impl's replay time. The guard stays: this only says what it costs.

Not a test: nothing here runs in CI (no timed assertions); its output goes to
reports/bench.md with the command that produced it.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

from kvspec.targets import load_target
from kvspec.targets.bench import BENCH_BLOCKS, build_trace, replay_times

REPORT = Path(__file__).resolve().parent.parent / "reports" / "bench.md"
_LINE = re.compile(r'^\{"target": "([^"]+)".*"cpu_ops_per_second": ([0-9.]+)')


def committed_figures(report: Path = REPORT) -> dict[str, float]:
    """``{target: cpu_ops_per_second}`` from the report's `kvspec bench --json` lines."""
    out: dict[str, float] = {}
    if report.exists():
        for line in report.read_text().splitlines():
            m = _LINE.match(line.strip())
            if m:
                out[m.group(1)] = float(m.group(2))
    return out


def guard_share(trace, rounds: int) -> dict:
    """impl's replay CPU time with and without BlockPool._check_own, interleaved."""
    from kvspec import impl

    impl_t = load_target("impl")
    real = impl.BlockPool._check_own
    with_guard: list[float] = []
    without: list[float] = []
    for r in range(rounds):
        for guarded in ((True, False) if r % 2 == 0 else (False, True)):
            impl.BlockPool._check_own = real if guarded else (lambda self, block, what: None)
            try:
                (with_guard if guarded else without).append(replay_times(impl_t, trace)[1])
            finally:
                impl.BlockPool._check_own = real
    g, n = statistics.median(with_guard), statistics.median(without)
    return {"with_guard_s": round(g, 4), "without_guard_s": round(n, 4), "guard_share": round(1 - n / g, 3)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="impl,vllm", help="comma list; impl is always included (the yardstick)")
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.15,
                    help="a ratio this far (relative) below the committed one is 'fell behind'")
    ap.add_argument("--guard-share", action="store_true")
    ap.add_argument("--report", default=str(REPORT), help="the committed figures (reports/bench.md)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    names = ["impl"] + [t for t in a.targets.split(",") if t and t != "impl"]
    targets = {n: load_target(n) for n in names}
    traces = {n: build_trace(t, a.ops, a.seed, BENCH_BLOCKS) for n, t in targets.items()}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            cpu[n].append(replay_times(targets[n], traces[n])[1])
    ops_s = {n: len(traces[n].ops) / statistics.median(cpu[n]) for n in names}
    committed = committed_figures(Path(a.report))
    rows = []
    behind = []
    for n in names:
        ratio = ops_s[n] / ops_s["impl"]
        ref = (committed[n] / committed["impl"]) if n in committed and "impl" in committed else None
        fell = ref is not None and ratio < ref * (1 - a.tolerance)
        if fell:
            behind.append(n)
        rows.append({"target": n, "cpu_ops_per_second": round(ops_s[n], 1), "ratio_to_impl": round(ratio, 3),
                     "committed_ratio_to_impl": None if ref is None else round(ref, 3),
                     "committed_cpu_ops_per_second": committed.get(n), "fell_behind": fell})
    res = {"ops": a.ops, "seed": a.seed, "rounds": a.rounds, "tolerance": a.tolerance, "rows": rows,
           "fell_behind": behind}
    if a.guard_share:
        res["impl_guard"] = guard_share(traces["impl"], a.rounds)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{a.ops} ops, seed {a.seed}, medians of {a.rounds} rotated rounds (CPU time)")
        print("| target | ops/s | ratio to impl | committed ratio (reports/bench.md) | fell behind |")
        print("|---|---|---|---|---|")
        for row in rows:
            ref = "-" if row["committed_ratio_to_impl"] is None else f"{row['committed_ratio_to_impl']:.3f}"
            print(f"| {row['target']} | {row['cpu_ops_per_second']:,.0f} | {row['ratio_to_impl']:.3f} | {ref} | "
                  f"{'yes' if row['fell_behind'] else 'no'} |")
        if "impl_guard" in res:
            g = res["impl_guard"]
            print(f"impl's ownership guard (BlockPool._check_own): {g['guard_share']:.1%} of impl's replay time "
                  f"({g['with_guard_s']} s with, {g['without_guard_s']} s without)")
        print("fell behind: " + (", ".join(behind) if behind else "none"))
    return 1 if behind else 0


if __name__ == "__main__":
    sys.exit(main())
