"""The `nanovllm` target: PyPI's nano-vllm-fork 20260210 BlockManager, driven through
kvspec's machines and model checker, nothing mocked: its real defect (a whole-prompt
prefix hit), kvspec's fix for it, the bug corpus (each diff through the patched-import
path), the repro files, and --patch errors.

Needs `pip install --no-deps -r requirements/upstream.txt` (nano-vllm-fork, plus xxhash
and numpy); skipped, with that reason, when the package is missing. The package itself
is never imported: only its engine's block_manager and sequence modules are loaded."""
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.upstream
if importlib.util.find_spec("nanovllm") is None:  # importorskip would run nanovllm/__init__ (torch, transformers)
    pytest.skip("nano-vllm-fork is not installed: pip install --no-deps -r requirements/upstream.txt",
                allow_module_level=True)
pytest.importorskip("xxhash", reason="nano-vllm-fork's block manager needs xxhash: pip install xxhash")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from kvspec.check.search import run_check  # noqa: E402
from kvspec.spec.config import Config  # noqa: E402
from kvspec.mc.enumerate_ops import Bounds  # noqa: E402
from kvspec.mc.search import confirm, model_check  # noqa: E402
from kvspec.spec.ops import Admit, Finish, Preempt, Step  # noqa: E402
from kvspec.patching import PatchError  # noqa: E402
from kvspec.check.session import Session  # noqa: E402
from kvspec.stateful import InvariantViolation, cache_machine  # noqa: E402
from kvspec.targets.base import TargetError  # noqa: E402
from kvspec.targets.nano_loader import load_nano, package_dir  # noqa: E402
from kvspec.targets.nanovllm_target import BOOLEAN  # noqa: E402
from kvspec.targets.registry import load_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "kvspec" / "corpus" / "nanovllm"
BUGS = json.loads((CORPUS / "bugs.json").read_text())
FIX = CORPUS / "fix_full_prompt_hit.diff"
MACHINE = settings(max_examples=60, stateful_step_count=40, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))
FIND = settings(MACHINE, phases=(Phase.generate,))
DEFECT = [Admit("r1", (1, 2)), Admit("r2", (1, 2))]  # the shortest repro of the real defect


@pytest.fixture(scope="module")
def nano():
    return load_target("nanovllm")


@pytest.fixture(scope="module")
def fixed():
    return load_target("nanovllm", patch=str(FIX))


# -- the real defect: a prefix hit covering the whole prompt ----------------------------
def test_unmodified_release_hits_the_whole_prompt(nano):
    s = Session(nano, Config(level="cache", num_blocks=4, block_size=2))
    assert s.apply(DEFECT[0]) == [] and s.last_result == 0
    found = s.apply(DEFECT[1])
    # allocate() hit both tokens: num_cached_tokens == len(seq), nothing left to prefill
    assert s.last_result == 2 and found and found[0].invariant == "MAX_HIT", found
    assert s.obs.requests["r2"].table == s.obs.requests["r1"].table == (0,) and s.obs.blocks[0].ref == 2


def test_check_and_mc_report_the_defect_with_the_shortest_repro(nano, tmp_path):
    report = run_check(nano, "nanovllm", level="cache", seed=0, max_examples=500, report_dir=str(tmp_path))
    assert report.verdict == "violation"
    f = report.violations[0]
    assert f.invariant == "MAX_HIT" and len(f.steps) == 2 and f.minimal
    assert all(isinstance(op, Admit) for op in f.steps) and f.steps[0].prompt == f.steps[1].prompt
    config = Config(level="cache", num_blocks=3, block_size=2)
    r = model_check(nano, config, 4, Bounds())
    assert r.verdict == "violation" and r.counterexample == DEFECT and confirm(nano, config, r)
    assert r.fork == "driver-snapshot"  # not pickle: that would import nanovllm/__init__


def test_the_fix_passes_the_machine_and_the_model_checker(fixed):
    machine = cache_machine(fixed)
    run_state_machine_as_test(machine, settings=MACHINE)
    assert machine.counters["steps"] > 300
    r = model_check(fixed, Config(level="cache", num_blocks=3, block_size=2), 5, Bounds())
    assert r.verdict == "pass" and r.states > 500


def test_the_same_machine_fails_the_release(nano):
    with pytest.raises(InvariantViolation) as e:
        run_state_machine_as_test(cache_machine(nano), settings=FIND)
    assert e.value.invariant == "MAX_HIT"


# -- adapter details -------------------------------------------------------------------------
def test_loaded_without_running_the_package_init(nano):
    assert "nanovllm.llm" not in sys.modules and "nanovllm.engine.llm_engine" not in sys.modules
    assert nano.api == BOOLEAN and nano.manager_cls.__module__ == "nanovllm.engine.block_manager"
    assert nano.traits.levels == ("cache",) and not nano.traits.null_block
    # declared for the release (kvspec.targets.policies.KNOWN), never probed: boolean
    # can_allocate counts every block; deallocate's "Fix" evicts
    assert nano.traits.admit_all_blocks and nano.traits.free_evicts and nano.traits.index_latest_wins


def test_sequences_follow_the_manager_block_size(nano):
    d = nano.driver(Config(level="cache", num_blocks=5, block_size=3))
    seq = d.new_seq([1, 2, 3, 4])
    assert type(seq).block_size == 256 and seq.block_size == 3 and seq.num_blocks == 2


def test_observation_reads_the_manager(nano):
    s = Session(nano, Config(level="cache", num_blocks=5, block_size=2))
    assert s.apply(Admit("r1", (1, 2, 3))) == [] and s.last_result == 0
    o = s.obs
    assert o.requests["r1"].table == (0, 1) and o.requests["r1"].computed == 3
    assert o.blocks[0].hash is not None and o.blocks[1].hash is None and o.queue == (2, 3, 4)
    assert s.apply(Step("r1", 4)) == [] and s.obs.blocks[1].hash is not None  # may_append hashed it
    assert s.apply(Step("r1", 5)) == [] and s.obs.requests["r1"].table == (0, 1, 2)
    assert s.apply(Finish("r1")) == []
    # tail first to the back of free_block_ids; the fork's deallocate drops the hashes
    assert s.obs.queue == (3, 4, 2, 1, 0) and all(b.hash is None for b in s.obs.blocks)


def test_refused_steps_and_preemption(nano):
    s = Session(nano, Config(level="cache", num_blocks=2, block_size=2))
    for op in (Admit("r1", (1, 2)), Admit("r2", (11, 12))):
        assert s.apply(op) == []
    assert s.apply(Step("r1", 3)) == [] and s.last_result is False  # no block free: refused
    assert s.apply(Preempt("r2")) == [] and s.apply(Step("r1", 4)) == [] and s.last_result is True
    assert s.obs.requests["r1"].computed == 4 and s.apply(Admit("r2")) == [] and s.last_result is None


def test_documented_noops(nano):
    s = Session(nano, Config(level="cache", num_blocks=4, block_size=2))
    assert s.apply(Finish("ghost")) == []
    assert s.apply(Admit("r1", (1, 2, 3, 4, 5))) == [] and s.apply(Admit("r2", (7, 8, 9))) == []
    assert s.last_result is None  # refused: r2 waits, holding nothing
    for op in (Preempt("r2"), Finish("r2"), Finish("r1"), Finish("r1")):  # deallocate of an empty Sequence
        assert s.apply(op) == [], op
    assert s.obs.free_count == 4


def test_snapshot_keeps_decoded_sequences(nano):
    # nano-vllm's Sequence.__getstate__ drops token_ids once a token was decoded
    d = nano.driver(Config(level="cache", num_blocks=4, block_size=2))
    d.apply(Admit("r1", (1, 2)))
    d.apply(Step("r1", 3))
    copy = d.restore(d.snapshot())
    assert copy.observe() == d.observe() and copy.apply(Step("r1", 4)) is True
    assert copy.seqs["r1"].token_ids == [1, 2, 3, 4] and d.seqs["r1"].token_ids == [1, 2, 3]


# -- the corpus -------------------------------------------------------------------------------
@pytest.mark.parametrize("bug", [b for b in BUGS if b["kind"] != "equivalent"], ids=lambda b: b["id"])
def test_each_corpus_patch_is_reported_with_its_invariant(bug, tmp_path):
    target = load_target("nanovllm", patch=str(CORPUS / bug["file"]))
    report = run_check(target, "nanovllm", patch=bug["file"], level="cache", seed=1, max_examples=3000,
                       report_dir=str(tmp_path))
    assert report.verdict == "violation", bug["id"]
    v = report.violations[0]
    assert v.invariant == bug["invariants"][0], (bug["id"], v.violations[0].message)


@pytest.mark.parametrize("bug", [b for b in BUGS if b["kind"] == "equivalent"], ids=lambda b: b["id"])
def test_equivalent_mutants_pass(bug, tmp_path):
    target = load_target("nanovllm", patch=str(CORPUS / bug["file"]))
    report = run_check(target, "nanovllm", level="cache", seed=1, max_examples=100, report_dir=str(tmp_path))
    assert report.verdict == "pass" and report.steps > 500


def test_corpus_shape():
    assert len([b for b in BUGS if b["kind"] != "equivalent"]) >= 5
    assert any(b["kind"] == "equivalent" and b["invariants"] == [] for b in BUGS)
    fix_line = "+            if i == seq.num_blocks - 1:\n"
    assert fix_line in FIX.read_text()
    for b in BUGS:
        assert set(b) == {"id", "title", "file", "upstream", "level", "invariants", "kind", "note"}
        assert b["file"] == f"{b['id']}.diff" and b["level"] == "cache"
        assert b["kind"] in ("safety", "policy", "equivalent")
        text = (CORPUS / b["file"]).read_text()
        assert text.startswith("--- a/nanovllm/engine/block_manager.py\n+++ b/nanovllm/engine/block_manager.py\n")
        if b["id"] != "hit_skip_token_check":  # that one rewrites the lines the fix touches
            assert fix_line in text, f"{b['id']} is not stacked on the fix"


def test_patches_never_touch_the_installed_files_or_leak_into_sys_modules(nano):
    installed = package_dir("nanovllm") / "engine" / "block_manager.py"
    before = hashlib.sha1(installed.read_bytes()).hexdigest()
    bm, _ = load_nano("nanovllm", (CORPUS / "alloc_mru.diff").read_text())
    patched = Path(bm.allocate.__code__.co_filename)
    assert bm is not nano.manager_cls and patched != installed and "free_block_ids[-1]" in patched.read_text()
    assert sys.modules["nanovllm.engine.block_manager"].BlockManager is nano.manager_cls
    assert "nanovllm" not in sys.modules  # the stand-in packages are gone again
    assert hashlib.sha1(installed.read_bytes()).hexdigest() == before


# -- --patch errors ----------------------------------------------------------------------------
def test_a_diff_that_does_not_apply_names_file_and_hunk(tmp_path):
    bad = tmp_path / "bad.diff"
    text = (CORPUS / "alloc_mru.diff").read_text()
    bad.write_text(text.replace("seq.num_cached_tokens += self.block_size", "seq.num_cached_tokens += 1"))
    with pytest.raises(TargetError) as e:
        load_target("nanovllm", patch=str(bad))
    msg = str(e.value)
    assert "\n" not in msg and "nanovllm/engine/block_manager.py: hunk '@@" in msg


def test_a_diff_outside_the_package_is_refused():
    with pytest.raises(PatchError, match="not under nanovllm/"):
        load_nano("nanovllm", "--- a/vllm/v1/core/block_pool.py\n+++ b/vllm/v1/core/block_pool.py\n@@ -1 +1 @@\n-x\n+y\n")


def test_missing_package_is_one_line():
    with pytest.raises(TargetError, match="package 'no_such_nano' is not installed"):
        load_target("nanovllm:no_such_nano")


# -- the CLI and its repro files ---------------------------------------------------------------
def _kvspec(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvspec.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env)


def _pytest(path, patch):
    env = dict(os.environ, KVSPEC_PATCH=patch) if patch is not None else None
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
                          capture_output=True, text=True, cwd=ROOT, env=env)


def test_cli_reports_the_defect_and_its_repro_replays(tmp_path):
    r = _kvspec("check", "--target", "nanovllm", "--level", "cache", "--json", "--max-examples", "500",
                "--report-dir", str(tmp_path))
    assert r.returncode == 1, r.stderr[-2000:]
    d = json.loads(r.stdout)
    v = d["violations"][0]
    assert d["verdict"] == "violation" and v["invariant"] == "MAX_HIT" and v["num_steps"] == 2
    assert _pytest(v["repro"], None).returncode == 1                # the release: fails
    assert _pytest(v["repro"], str(FIX)).returncode == 0            # with the fix: passes


def test_cli_patch_repro_fails_patched_and_passes_unpatched(tmp_path):
    r = _kvspec("check", "--target", "nanovllm", "--patch", str(CORPUS / "dealloc_forward.diff"), "--json",
                "--max-examples", "2000", "--seed", "1", "--report-dir", str(tmp_path))
    assert r.returncode == 1, r.stderr[-2000:]
    v = json.loads(r.stdout)["violations"][0]
    assert v["invariant"] == "EVICTION_ORDER"
    assert _pytest(v["repro"], None).returncode == 1       # the embedded patch
    assert _pytest(v["repro"], "none").returncode == 0     # the release (no whole-prompt hit in these steps)


def test_cli_bad_patch_is_one_line(tmp_path):
    bad = tmp_path / "bad.diff"
    bad.write_text((CORPUS / "hit_no_ref.diff").read_text().replace("block.ref_count += 1", "block.refs += 1"))
    r = _kvspec("check", "--target", "nanovllm", "--patch", str(bad))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "block_manager.py: hunk '@@" in lines[0]
