"""benchmarks/mc_largest.py, the script behind reports/mc_largest*.md: a one-rung ladder
really runs ``kvspec mc`` and reports what it found, a cap other than 60 s writes its
own report, and ``--render`` writes the same Markdown again from the JSON."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "mc_largest.py"


def _script():
    name = "kvspec_bench_mc_largest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_one_rung_runs_the_checker_and_renders_again(tmp_path, capsys):
    ml = _script()
    assert ml.main(["--cap", "30", "--levels", "pool", "--ladder-max", "1", "--out", str(tmp_path),
                    "--calibrate", "pool:3:8", "--workers", "2"]) == 0
    capsys.readouterr()
    # a cap other than 60 s: its own files, so the 60 s report is not overwritten
    assert not (tmp_path / "mc_largest.md").exists()
    data = json.loads((tmp_path / "mc_largest_30s.json").read_text())
    (run,) = data["runs"]["after"]["pool"]
    blocks, depth = ml.LADDERS["pool"]["ladder"][0]
    # the same configuration in this process: the script reports the checker's own counts
    from kvspec.mc.enumerate_ops import Bounds
    from kvspec.mc.search import model_check
    from kvspec.spec.config import Config
    from kvspec.targets import load_target
    ref = model_check(load_target("impl"), Config(level="pool", num_blocks=blocks + 1), depth, Bounds())
    assert run["ok"] and run["verdict"] == "pass" and run["states"] == ref.states > 1
    assert run["workers"] == 2 and "--workers 2" in run["command"]   # two processes find the same states
    cal = data["calibration"]   # the fixed search, run first in one process
    assert (cal["level"], cal["blocks"], cal["depth"], cal["states"]) == ("pool", blocks, depth, ref.states)
    md = (tmp_path / "mc_largest_30s.md").read_text()
    assert f"{blocks} blocks, depth {depth}: {ref.states:,} states" in md
    assert "both revisions" not in md   # one revision ran: nothing compared
    assert f"Calibration: pool level, {blocks} blocks, depth {depth}" in md
    (tmp_path / "mc_largest_30s.md").unlink()
    assert ml.main(["--render", str(tmp_path / "mc_largest_30s.json")]) == 0
    assert (tmp_path / "mc_largest_30s.md").read_text() == md
