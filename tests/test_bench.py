"""``kvspec bench``: the fixed-seed trace, its resolution on a target, and the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec.targets.bench import BENCH_BLOCKS, OCCUPANCY, bench, build_trace, plan_trace
from kvspec.cli import main
from kvspec.spec.config import Config
from kvspec.spec.model import PoolModel
from kvspec.check.session import run_steps
from kvspec.targets import load_target
from kvspec.targets.base import Traits


def test_plan_is_fixed_by_the_seed():
    assert plan_trace(3000, seed=1) == plan_trace(3000, seed=1)
    assert plan_trace(3000, seed=1) != plan_trace(3000, seed=2)


def test_plan_holds_about_three_quarters_of_the_pool():
    plan = plan_trace(20_000, seed=0)
    model = PoolModel(Config(level="pool", num_blocks=BENCH_BLOCKS), Traits())
    usable = len(model.usable())
    live, held_after = {}, []
    for s in plan:  # replay the plan's allocation decisions on a fresh model
        if s[0] == "alloc":
            live[s[1]] = model.alloc(s[2])
        elif s[0] == "cache":
            for b, h in zip(live[s[1]], s[2]):
                model.cache(b, h)
        elif s[0] == "free":
            model.free(list(reversed(live.pop(s[1]))))
        elif s[2] is not None:
            b = model.lookup(s[1])
            model.touch([b])
            live[s[2]] = [b]
        held_after.append(usable - model.free_count())
    steady = held_after[len(held_after) // 2:]
    mean = sum(steady) / len(steady) / usable
    assert abs(mean - OCCUPANCY) < 0.05, mean
    kinds = {s[0] for s in plan}
    assert kinds == {"alloc", "cache", "free", "lookup"}


def test_trace_is_valid_use_of_impl():
    """The resolved trace is valid use: replayed with every invariant checked, nothing fires."""
    target = load_target("impl")
    trace = build_trace(target, 3000, seed=0, num_blocks=64)
    assert set(trace.mix) == {"Alloc", "Cache", "Free", "Lookup", "Touch"}
    assert trace.dropped_hits == 0
    out = run_steps(target, Config(level="pool", num_blocks=64), trace.ops)
    assert not out.failed, out.violations


def test_bench_json_cli(capsys):
    assert main(["bench", "--target", "impl", "--ops", "3000", "--seed", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["target"] == "impl" and r["seed"] == 3 and r["num_blocks"] == BENCH_BLOCKS
    assert r["ops_per_second"] > 0 and r["cpu_ops_per_second"] > 0 and abs(r["ops"] - 3000) <= 2
    assert sum(r["mix"].values()) == r["ops"]


def test_bench_text_cli(capsys):
    assert main(["bench", "--ops", "1000"]) == 0
    out = capsys.readouterr().out
    assert "ops/s" in out and "nothing checked" in out


def test_bench_refuses_a_target_without_pool_level(capsys, tmp_path):
    f = tmp_path / "only_cache.py"
    f.write_text("from kvspec.targets.base import Target, Traits\n"
                 "class T(Target):\n    name = 'x'\n    traits = Traits(levels=('cache',))\n"
                 "    def driver(self, config):\n        raise AssertionError\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("only_cache", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from kvspec.targets.base import TargetError

    with pytest.raises(TargetError, match="no pool-level API"):
        bench(mod.T(), 100)
    assert main(["bench", "--ops", "0"]) == 2
    assert "--ops must be positive" in capsys.readouterr().err


def test_mc_instructions_says_in_one_line_that_it_needs_valgrind(monkeypatch, capsys, tmp_path):
    """benchmarks/mc_instructions.py counts instructions under valgrind; without it, one line and exit 2."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "mc_instructions.py"
    spec = importlib.util.spec_from_file_location("mc_instructions", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("PATH", str(tmp_path))   # an empty folder: no valgrind on it
    assert mod.main(["--config", "pool:2:1:nosym"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mc_instructions: needs valgrind on PATH"]
