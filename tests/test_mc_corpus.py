"""Every self-test bug patch: mc finds it, ``check`` reports exactly mc's shortest
length (its ddmin result is cut down to that by the bounded BFS), and the repro files
fail on the patch and pass without it."""
import importlib.util
import json
from pathlib import Path

import pytest

from kvspec.check.search import run_check
from kvspec.spec.config import Config
from kvspec.mc.enumerate_ops import Bounds
from kvspec.mc.search import confirm, model_check
from kvspec.check.repro import write_repro
from kvspec.targets import load_target

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"
# The foundation's ten self-test patches: the acceptance is stated on these. The
# later corpus has cache-level bugs whose check repros use tokens outside mc's small
# prompt domain, equivalent mutants and a rare-input bug that only `kvspec diff` reaches.
BUGS = [b for b in json.loads((CORPUS / "bugs.json").read_text()) if b.get("foundation")]


def run_repro_file(path: Path, monkeypatch, patch_env):
    """Import a repro file and run its one test function, as pytest would."""
    if patch_env is None:
        monkeypatch.delenv("KVSPEC_PATCH", raising=False)
    else:
        monkeypatch.setenv("KVSPEC_PATCH", patch_env)
    spec = importlib.util.spec_from_file_location(f"repro_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (test,) = [v for k, v in vars(mod).items() if k.startswith("test_")]
    test()


@pytest.mark.parametrize("bug", BUGS, ids=[b["id"] for b in BUGS])
def test_check_reports_mc_shortest_length(bug, tmp_path, monkeypatch):
    path = str(CORPUS / bug["file"])
    target = load_target("impl", patch=path)
    patch_text = Path(path).read_text()

    # mc on its default configuration finds the bug
    usable = 4
    found = model_check(target, Config(level=bug["level"], num_blocks=usable + 1), 8, time_cap=60)
    assert found.verdict == "violation", bug["id"]
    assert confirm(target, found.config, found)

    # check: Hypothesis, ddmin, then the bounded BFS
    report = run_check(target, "impl", patch=path, patch_text=patch_text, level=bug["level"], seed=1,
                       max_examples=1000, report_dir=str(tmp_path / "check"))
    assert report.violations, bug["id"]
    f = report.violations[0]
    assert f.minimal is True, (bug["id"], f.steps, f.config)
    d = f.to_dict()
    assert d["minimal"] is True and d["num_steps"] == len(f.steps) and d["config"] == f.config.to_dict()

    # mc on the configuration of check's repro: the same invariant, the same length
    shortest = model_check(target, f.config, len(f.steps), Bounds(), invariant=f.invariant, time_cap=60)
    assert shortest.verdict == "violation", (bug["id"], f.steps)
    assert len(shortest.counterexample) == len(f.steps), (bug["id"], f.steps, shortest.counterexample)
    # ... and nothing of any kind shorter either, when check found the bug's own invariant
    if f.invariant == bug["invariants"][0]:
        plain = model_check(target, f.config, len(f.steps), Bounds(), time_cap=60)
        assert plain.verdict == "violation" and len(plain.counterexample) == len(f.steps)

    # the repro files: check's and mc's both fail patched and pass unpatched
    mc_repro = write_repro(tmp_path / "mc", "impl", target, f.config, shortest.counterexample, f.invariant,
                           shortest.violations[0].message, patch_text=patch_text, patch_name=path, minimal=True)
    for repro in (Path(f.repro), mc_repro):
        with pytest.raises(AssertionError, match=f.invariant):
            run_repro_file(repro, monkeypatch, None)
        run_repro_file(repro, monkeypatch, "none")


ALL_BUGS = json.loads((CORPUS / "bugs.json").read_text())


@pytest.mark.parametrize("bug", ALL_BUGS, ids=[b["id"] for b in ALL_BUGS])
def test_checking_a_state_once_finds_every_bug_at_the_same_length(bug):
    """The state invariants run once per distinct state (the default) or after every
    transition: the same verdict, states, and shortest counterexample, for every corpus
    bug, pool and cache level (bounded by a state count, never by time)."""
    target = load_target("impl", patch=str(CORPUS / bug["file"]))
    cfg = Config(level=bug["level"], num_blocks=4 + 1)
    once = model_check(target, cfg, 8, max_states=800, time_cap=600, check_once=True)
    every = model_check(target, cfg, 8, max_states=800, time_cap=600, check_once=False)
    assert (once.verdict, once.states, once.levels, once.invariant, once.counterexample) == \
        (every.verdict, every.states, every.levels, every.invariant, every.counterexample), bug["id"]
    assert once.check_once and not every.check_once
    if bug.get("foundation"):
        assert once.verdict == "violation", bug["id"]
