"""Examples to failure of every safety bug of a corpus, per seed, at the bug's level:
the measurement the pytest plugin's ``ci`` profile is sized from (reports/profiles.md).

    python benchmarks/measure_profile_ci.py --target vllm --seeds 3 --cap 600 > out.json

Each trial is exactly what ``kvspec check --target T --patch P --level L --max-examples CAP
--seed S`` runs (the same batches, seeded the same way), without the minimizer: a
trial's number is the examples run at that level when the first violation was found,
or null when none was found within CAP. One forked child per patch (a patched target is
loaded once per forked child; the parent imports the package once)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "kvspec" / "corpus"


def trial(target_spec: str, patch: str, level: str, kv_groups, seeds: list[int], cap: int) -> list[dict]:
    from kvspec.check.search import EXAMPLES_PER_BATCH, LevelSearch
    from kvspec.targets import load_target

    target = load_target(target_spec, patch=patch)
    out = []
    for seed in seeds:
        search = LevelSearch(target, level, misuse=False, seed=seed, kv_groups=kv_groups)
        start, found = time.monotonic(), None
        while found is None and search.machine.counters["examples"] < cap:  # run_check's loop, one level
            found = search.run_batch(min(EXAMPLES_PER_BATCH, cap - search.machine.counters["examples"]))
        out.append({"seed": seed, "examples_to_failure": search.machine.counters["examples"] if found else None,
                    "invariant": found.violations[0].invariant if found else None,
                    "examples": search.machine.counters["examples"], "seconds": round(time.monotonic() - start, 2)})
    return out


def _child(q, target: str, b: dict, seeds: int, cap: int) -> None:
    try:
        q.put(trial(target, str(CORPUS / target / b["file"]), b["level"], b.get("kv_groups"), list(range(seeds)), cap))
    except BaseException as e:  # noqa: BLE001 - reported as the row's error
        q.put([{"error": f"{type(e).__name__}: {e}"}])


def _forked(target: str, b: dict, seeds: int, cap: int) -> list[dict]:
    """One forked child per patch: the parent imported the target's package once (vLLM
    and torch take minutes to import on a loaded machine), each patch loads in a child."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, target, b, seeds, cap))
    p.start()
    out = q.get()
    p.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", choices=["impl", "vllm"], required=True)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cap", type=int, default=600)
    ap.add_argument("--only", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one patch, JSON on stdout
    a = ap.parse_args()
    bugs = json.loads((CORPUS / a.target / "bugs.json").read_text())
    if a.one:
        b = next(x for x in bugs if x["id"] == a.one)
        print(json.dumps(trial(a.target, str(CORPUS / a.target / b["file"]), b["level"], b.get("kv_groups"),
                               list(range(a.seeds)), a.cap)))
        return 0
    only = set(a.only.split(",")) if a.only else None
    from kvspec.targets import load_target
    load_target(a.target)  # warm: every child inherits the imports
    rows = []
    for b in bugs:
        if b["kind"] != "safety" or b.get("engine") == "diff" or (only and b["id"] not in only):
            continue
        t0 = time.monotonic()
        trials = _forked(a.target, b, a.seeds, a.cap)
        row = {"id": b["id"], "level": b["level"], "kv_groups": b.get("kv_groups"), "trials": trials,
               "wall_s": round(time.monotonic() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"target": a.target, "seeds": a.seeds, "cap": a.cap, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
