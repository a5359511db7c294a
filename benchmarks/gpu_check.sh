#!/usr/bin/env bash
# One device call: GPU correctness sweep, then the kernel benchmark, each run twice
# (the spread between the two is the noise). Run on the device machine from the repo root:
#   bash benchmarks/gpu_check.sh        (writes under $OUT, or reports/gpu if OUT is unset)
#   BENCH_RUNS=1 AB_ROUNDS=3 AB_TILES=64 bash benchmarks/gpu_check.sh   (one benchmark, then the
#   default decode launch against tile 64, three interleaved rounds: benchmarks/tune_decode_gpu.py)
set -u
OUT=${OUT:-reports/gpu}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET
# kvspec.kernels, kvspec.impl and kvspec.stateful are mapped by pyproject's package-dir; the device
# image has no kvspec install, so lay that mapping out with symlinks (no pip, nothing fetched)
SHIM=$(mktemp -d); mkdir "$SHIM/kvspec"
for f in "$PWD"/kvspec/*; do ln -s "$f" "$SHIM/kvspec/"; done
ln -s "$PWD/kernels" "$SHIM/kvspec/kernels"; ln -s "$PWD/impl" "$SHIM/kvspec/impl"; ln -s "$PWD/stateful" "$SHIM/kvspec/stateful"
export PYTHONPATH=$SHIM:$PYTHONPATH
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.csv"
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee "$OUT/versions.txt"
for i in 1 2; do
  # from $SHIM: with -m, the working directory comes first on sys.path, and the repo's kvspec/ lacks kernels/
  (cd "$SHIM" && timeout 120 $PY -m kvspec.cli kernels --device cuda --json --seed $i > "$OUT/kernels_cuda_seed$i.json" 2> "$OUT/kernels_cuda_seed$i.err")
  echo "sweep seed $i rc=$?"; tail -3 "$OUT/kernels_cuda_seed$i.err"
done
for i in ${BENCH_RUNS:-1 2}; do
  mkdir -p "$OUT/bench$i"
  timeout 150 $PY benchmarks/bench_kernels_gpu.py --out-dir "$OUT/bench$i" > "$OUT/bench$i/stdout.txt" 2> "$OUT/bench$i/stderr.txt"
  echo "bench $i rc=$?"; tail -3 "$OUT/bench$i/stderr.txt"
done
if [ -n "${AB_ROUNDS:-}" ]; then  # the default decode launch against a forced key tile, interleaved (AB_TILES)
  timeout 200 $PY benchmarks/tune_decode_gpu.py --splits none --tiles none ${AB_TILES:-64} --rounds "$AB_ROUNDS" \
    --json-out "$OUT/decode_ab.json" > "$OUT/decode_ab.txt" 2>&1
  echo "decode A/B rc=$?"; grep -v "^copy GB/s" "$OUT/decode_ab.txt" | tail -8
fi
$PY - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("kernels_cuda_seed*.json")):
    try:
        d = json.loads(f.read_text())
        print(f.name, "passed", d.get("passed"), "cases", d.get("cases"),
              {k: round(v["worst_ratio"], 3) for k, v in d.get("per_dtype", {}).items()})
    except Exception as e:
        print(f.name, "unreadable", e)
for f in sorted(out.glob("bench*/kernels.json")):
    d = json.loads(f.read_text())
    dec, ext = d["decode"], d["extend"]
    print(f.parent.name, "copy GB/s %.0f" % d["copy_bandwidth_gbps"],
          "| decode %.3f ms %.0f GB/s (%.2f of copy) sdpa %.3f ms x%.2f diff %.3g" % (
              dec["ms"], dec["gbps"], dec["fraction_of_copy_bw"], dec["sdpa_ms"], dec["speedup_vs_sdpa"], dec["max_abs_diff_vs_sdpa"]),
          "| extend %.3f ms %.1f TFLOP/s sdpa %.3f ms x%.2f diff %.3g" % (
              ext["ms"], ext["tflops"], ext["sdpa_ms"], ext["speedup_vs_sdpa"], ext["max_abs_diff_vs_sdpa"]))
    print("  curve", [(r["context"], round(r["fraction_of_copy_bw"], 2)) for r in d["bandwidth_vs_context"]])
PY
