#!/usr/bin/env bash
# The corpus run both ways, side by side on this machine: `kvspec patches --jobs $JOBS`
# (benchmarks/run_patches.sh) and the same matrix through `kvspec campaign`
# (CAMPAIGN=1 benchmarks/run_patches.sh, a local Ray), back to back, ROUNDS times,
# alternating which goes first (the machine may be shared: the spread between rounds
# says how much the other load moved the numbers). Per round: both wall times (Ray's
# start included), their ratio, and each patch's kills per seed by both paths.
#
#   benchmarks/bench_campaign_vs_jobs.sh                 # nanovllm, 3 seeds, 20 s, 2 rounds
#   TARGETS=impl SEEDS=2 TIMEOUT=10 ROUNDS=1 PER_JOB=1 WARM=false OUT=/tmp/b benchmarks/bench_campaign_vs_jobs.sh
#
# WARM=false runs the campaign's jobs as fresh processes (the path before warm workers).
set -euo pipefail
cd "$(dirname "$0")/.."
export TARGETS="${TARGETS:-nanovllm}" SEEDS="${SEEDS:-3}" TIMEOUT="${TIMEOUT:-20}"
ROUNDS="${ROUNDS:-2}"
JOBS="${JOBS:-2}"
PER_JOB="${PER_JOB:-1}"
WARM="${WARM:-true}"
OUT="${OUT:-/tmp/kvspec-bench-campaign}"
rm -rf "$OUT"
mkdir -p "$OUT"

pool() {  # $1: round dir
  local s=$(date +%s.%N)
  JOBS="$JOBS" REPORT_DIR="$1/pool" benchmarks/run_patches.sh > "$1/pool.log" 2>&1 || true
  python -c "import time; print(round(time.time() - $s, 1))" > "$1/pool.seconds"
}

campaign() {
  local s=$(date +%s.%N)
  CAMPAIGN=1 PER_JOB="$PER_JOB" CAMPAIGN_WARM="$WARM" RESULTS="$1/results" REPORT_DIR="$1/camp" \
    benchmarks/run_patches.sh > "$1/camp.log" 2>&1 || true
  python -c "import time; print(round(time.time() - $s, 1))" > "$1/camp.seconds"
}

for r in $(seq 1 "$ROUNDS"); do
  d="$OUT/round$r"
  mkdir -p "$d"
  if [ $((r % 2)) = 1 ]; then pool "$d"; campaign "$d"; first=pool; else campaign "$d"; pool "$d"; first=campaign; fi
  echo "$first" > "$d/first"
  uptime > "$d/load"
done

python - "$OUT" "$ROUNDS" <<'EOF'
import json, sys
from pathlib import Path

out, rounds = Path(sys.argv[1]), int(sys.argv[2])


def kills(d: Path) -> dict:
    try:
        doc = json.loads((d / "patches.json").read_text())
    except (OSError, ValueError):
        return {}
    got = {}
    for section, res in doc["targets"].items():
        got[(section.split()[0], "verdict")] = res["verdict"]
        for t in res["trials"]:
            got.setdefault((section.split()[0], t["id"]), []).append(int(bool(t["killed"])))
    return got


lines = ["| round (first) | `kvspec patches --jobs` | campaign | campaign / jobs | same kills per patch and seed | load at end |",
         "|---|---|---|---|---|---|"]
for r in range(1, rounds + 1):
    d = out / f"round{r}"
    p, c = float((d / "pool.seconds").read_text()), float((d / "camp.seconds").read_text())
    a, b = kills(d / "pool"), kills(d / "camp")
    diff = sorted(str(k) for k in set(a) | set(b) if a.get(k) != b.get(k))
    same = "yes" if a and a == b else ("no: " + ", ".join(diff) if a and b else "missing report")
    load = (d / "load").read_text().split("load average:")[-1].strip()
    lines.append(f"| {r} ({(d / 'first').read_text().strip()}) | {p:.1f} s | {c:.1f} s | **{c / p:.2f}** | {same} | {load} |")
text = "\n".join(lines)
(out / "summary.md").write_text(text + "\n")
print(text)
EOF
