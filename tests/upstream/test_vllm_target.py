"""The `vllm` target: the installed vLLM 0.33.0's BlockPool and KVCacheManager, driven
through kvspec's machines, its bug corpus (each diff imported through the patched-import
path, in this one process), its misuse robustness findings, and --patch errors.

Needs `pip install --no-deps -r requirements/upstream.txt`; skipped, with that reason,
when the vLLM allocator cannot be imported."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.upstream
pytest.importorskip("vllm.v1.core.kv_cache_manager",
                    reason="vllm's allocator is not importable: pip install --no-deps -r requirements/upstream.txt")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from kvspec.check.search import LevelSearch, run_check  # noqa: E402
from kvspec.spec.config import Config  # noqa: E402
from kvspec.spec.ops import Admit, Alloc, Cache, Finish, Free, FreeForeign, Lookup, Step, Touch  # noqa: E402
from kvspec.patching import PatchError  # noqa: E402
from kvspec.check.session import Session  # noqa: E402
from kvspec.stateful import InvariantViolation, cache_machine, pool_machine  # noqa: E402
from kvspec.targets.base import TargetError  # noqa: E402
from kvspec.targets.registry import load_target  # noqa: E402
from kvspec.vllm.compat import parse_spec  # noqa: E402
from kvspec.vllm.patch import import_vllm, vllm_root  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "kvspec" / "corpus" / "vllm"
BUGS = json.loads((CORPUS / "bugs.json").read_text())
MACHINE = settings(max_examples=150, stateful_step_count=40, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))
FIND = settings(MACHINE, phases=(Phase.generate,))  # finding is enough; shrinking costs seconds


@pytest.fixture(scope="module")
def vllm():
    return load_target("vllm")


def run_machine(machine, how: settings = MACHINE) -> None:
    run_state_machine_as_test(machine, settings=how)


# -- unmodified vLLM passes; the same machines fail on a broken one ---------------------
@pytest.mark.parametrize("make", [pool_machine, cache_machine], ids=["pool", "cache"])
def test_unmodified_vllm_passes_the_machines(vllm, make):
    machine = make(vllm)
    run_machine(machine)
    assert machine.counters["steps"] > 500


@pytest.mark.parametrize("make, bug", [(pool_machine, "touch_keeps_queued"), (cache_machine, "full_prompt_hit")],
                         ids=["pool", "cache"])
def test_the_machines_can_fail(make, bug):
    with pytest.raises(InvariantViolation):
        run_machine(make(load_target("vllm", patch=str(CORPUS / f"{bug}.diff"))), FIND)


# -- adapter details --------------------------------------------------------------------
def test_labels_are_upstream_block_hashes(vllm):
    up = vllm.up
    utils = up.utils
    assert up.label_hash("a", 2) == utils.hash_block_tokens(up.hash_fn, None, [97, 97], ("a",))
    assert utils.NONE_HASH is not None and up.label_hash("a", 2) != up.label_hash("b", 2)
    # labels that agree on their first block_size code points must still differ
    assert up.label_hash("c1", 2) != up.label_hash("c12", 2)
    s = Session(vllm, Config(level="pool", num_blocks=4))
    for op in (Alloc(1), Cache((1,), ("a",)), Free((1,))):
        assert s.apply(op) == []
    assert s.obs.blocks[1].hash == utils.make_block_hash_with_group_id(up.label_hash("a", 2), 0)
    assert s.apply(Lookup("a")) == [] and s.last_result == 1


def test_labels_sharing_a_prefix_name_different_blocks(vllm):
    s = Session(vllm, Config(level="pool", num_blocks=4))
    for op in (Alloc(2), Cache((1, 2), ("c1", "c12")), Free((1, 2))):
        assert s.apply(op) == []
    assert s.apply(Lookup("c12")) == [] and s.last_result == 2
    assert s.apply(Lookup("c1")) == [] and s.last_result == 1


def test_cache_level_reads_upstream_request_tables(vllm):
    s = Session(vllm, Config(level="cache", num_blocks=6, block_size=2))
    assert s.apply(Admit("r1", (1, 2, 3, 4, 5))) == [] and s.last_result == 0
    assert s.obs.requests["r1"].table == (1, 2, 3) and s.obs.requests["r1"].computed == 5
    assert s.apply(Admit("r2", (1, 2, 3, 4, 9))) == [] and s.last_result == 4  # two cached blocks hit
    assert s.obs.requests["r2"].table[:2] == (1, 2) and s.obs.blocks[1].ref == 2
    assert s.apply(Step("r2", 7)) == [] and s.obs.requests["r2"].computed == 6
    assert s.apply(Finish("r1")) == [] and s.apply(Finish("r2")) == []
    # vLLM's documented order: r1's unhashed block 3 to the queue front; cached blocks to the
    # tail, each request's tail first (r2's block 4 was filled by the decode step).
    assert s.obs.queue == (3, 5, 4, 2, 1) and s.obs.free_count == 5


def test_documented_noops_are_not_misuse(vllm):
    s = Session(vllm, Config(level="pool", num_blocks=4))
    for op in (Touch((0,)), Free((0,)), FreeForeign(1), Alloc(2), Free((0, 1))):
        assert s.apply(op) == [], op
    c = Session(vllm, Config(level="cache", num_blocks=4))
    assert c.apply(Finish("ghost")) == []


# -- the corpus, each diff through the patched-import path ------------------------------
# The bugs of vLLM's cache features (KV-cache groups, windows, drafts, extra keys, connector
# tokens, chunks, the max_model_len cap) run at the cache level in their own groups. Their
# minimization is bounded by work here, not time: 0.1 to 13 s each on seed 1, but up to
# minutes on other seeds (seed 0: 17 to 146 s), so they run in the slow set; the fast test
# below finds every cache bug unminimized.
FEATURE_BUGS = {"hybrid_hit_not_truncated", "swa_free_off_by_one", "lora_not_hashed", "mm_offset_not_hashed",
                "spec_tokens_no_slots", "external_behind_window", "max_model_len_off_by_one",
                "chunk_caches_uncomputed"}


# A long-sequence policy (its repro decodes past the prompt, preempts and re-admits five
# times) takes about four minutes to minimize, the suite's longest test: it is found
# unminimized, with its invariant, by test_each_cache_bug_is_found_unminimized, and
# minimized by `kvspec patches` (reports/patches.md).
LONG_MINIMIZATION = {"hit_window_cap"}


def _param(b: dict):
    return pytest.param(b, id=b["id"], marks=[pytest.mark.slow] if b["id"] in FEATURE_BUGS else [])


@pytest.mark.parametrize("bug", [_param(b) for b in BUGS
                                 if b["kind"] != "equivalent" and b["id"] not in LONG_MINIMIZATION])
def test_each_corpus_patch_is_reported_with_its_invariant(bug, tmp_path):
    target = load_target("vllm", patch=str(CORPUS / bug["file"]))
    level = "cache" if bug["id"] in FEATURE_BUGS else "all"
    report = run_check(target, "vllm", patch=bug["file"], level=level, seed=1, max_examples=3000,
                       report_dir=str(tmp_path), kv_groups=bug.get("kv_groups"))
    assert report.verdict == "violation", bug["id"]
    v = report.violations[0]
    # the primary invariant, or another symptom of the same bug that bugs.json lists
    assert v.invariant in bug["invariants"], (bug["id"], v.violations[0].message)
    assert v.level == bug["level"] or bug["level"] == "pool"  # a pool bug may show first at the cache level


@pytest.mark.parametrize("bug", [b for b in BUGS if b["kind"] != "equivalent" and b["level"] == "cache"],
                         ids=lambda b: b["id"])
def test_each_cache_bug_is_found_unminimized(bug):
    """Every cache-level bug, in its own KV-cache groups (bugs.json ``kv_groups``, as
    ``kvspec patches`` runs it), is found within 40 batches of examples (1,000), seed 1."""
    search = LevelSearch(load_target("vllm", patch=str(CORPUS / bug["file"])), "cache", misuse=False, seed=1,
                         kv_groups=bug.get("kv_groups"))
    finding = next((f for f in (search.run_batch() for _ in range(40)) if f is not None), None)
    assert finding is not None, bug["id"]
    assert finding.invariant in bug["invariants"], (bug["id"], finding.violations[0].message)


@pytest.mark.parametrize("bug", [b for b in BUGS if b["kind"] == "equivalent"], ids=lambda b: b["id"])
def test_equivalent_mutants_pass(bug, tmp_path):
    target = load_target("vllm", patch=str(CORPUS / bug["file"]))
    report = run_check(target, "vllm", level="all", seed=1, max_examples=150, report_dir=str(tmp_path))
    assert report.verdict == "pass" and report.steps > 1000


def test_corpus_shape():
    assert len([b for b in BUGS if b["kind"] != "equivalent"]) >= 12
    assert FEATURE_BUGS <= {b["id"] for b in BUGS if b["kind"] == "safety"}
    assert any(b["kind"] == "equivalent" and b["invariants"] == [] for b in BUGS)
    for b in BUGS:
        assert set(b) - {"kv_groups"} == {"id", "title", "file", "upstream", "level", "invariants", "kind", "note"}
        if "kv_groups" in b:  # the configuration a hybrid bug needs, passed to every trial
            assert b["level"] == "cache" and len(parse_spec(b["kv_groups"])) >= 2, b["id"]
        assert b["file"] == f"{b['id']}.diff" and (CORPUS / b["file"]).is_file()
        assert b["level"] in ("pool", "cache") and b["kind"] in ("safety", "policy", "equivalent")
        assert (CORPUS / b["file"]).read_text().startswith("--- a/vllm/v1/core/")


def test_patches_never_touch_the_installed_files_or_leak_into_sys_modules():
    files = sorted((vllm_root() / "vllm" / "v1" / "core").glob("*.py"))
    before = {f: hashlib.sha1(f.read_bytes()).hexdigest() for f in files}
    original = sys.modules["vllm.v1.core.block_pool"].BlockPool
    patched = import_vllm((CORPUS / "touch_keeps_queued.diff").read_text())
    assert patched["vllm.v1.core.block_pool"].BlockPool is not original
    assert sys.modules["vllm.v1.core.block_pool"].BlockPool is original
    import vllm.v1.core as core
    assert core.block_pool.BlockPool is original
    assert before == {f: hashlib.sha1(f.read_bytes()).hexdigest() for f in files}


# -- misuse: vLLM documents no defence, so these are robustness findings ---------------
def test_double_free_leaves_a_negative_ref_count(vllm):
    s = Session(vllm, Config(level="pool", num_blocks=4))
    s.apply(Alloc(1))
    s.apply(Free((1,)))
    found = s.apply(Free((1,)))
    assert s.obs.blocks[1].ref == -1 and {"ATOMIC_REJECT", "ACCOUNTING", "I1"} <= {v.invariant for v in found}


def test_same_block_twice_in_one_free_call(vllm):
    s = Session(vllm, Config(level="pool", num_blocks=4))
    s.apply(Alloc(1))
    found = s.apply(Free((1, 1)))
    assert s.obs.blocks[1].ref == -1 and found and found[0].invariant == "ATOMIC_REJECT"


def test_negative_count_raises_the_free_counter(vllm):
    s = Session(vllm, Config(level="pool", num_blocks=4))
    found = s.apply(Alloc(-1))
    assert s.obs.free_count == 4 and len(s.obs.queue) == 3
    assert {"ATOMIC_REJECT", "ACCOUNTING"} <= {v.invariant for v in found}


def test_misuse_check_reports_robustness_not_violations(vllm, tmp_path):
    report = run_check(vllm, "vllm", level="pool", misuse=True, seed=0, max_examples=300, report_dir=str(tmp_path))
    assert report.verdict == "pass" and not report.violations
    assert report.robustness and all(f.kind == "robustness" for f in report.robustness)
    assert {"Free", "Alloc"} <= {type(f.steps[-1]).__name__ for f in report.robustness}


# -- --patch errors ------------------------------------------------------------------------
def test_a_diff_that_does_not_apply_names_file_and_hunk(tmp_path):
    text = (CORPUS / "touch_keeps_queued.diff").read_text().replace("ref_cnt=0 means", "ref_cnt=7 means")
    with pytest.raises(PatchError) as e:
        import_vllm(text)
    msg = str(e.value)
    assert "\n" not in msg and "vllm/v1/core/block_pool.py" in msg and "@@ -803,8 +803,6 @@" in msg
    bad = tmp_path / "bad.diff"
    bad.write_text(text)
    with pytest.raises(TargetError, match="block_pool.py: hunk"):
        load_target("vllm", patch=str(bad))


def test_a_diff_outside_the_vllm_package_is_refused():
    with pytest.raises(PatchError, match="not a Python file of the vllm package"):
        import_vllm("--- a/impl/block_pool.py\n+++ b/impl/block_pool.py\n@@ -1,1 +1,1 @@\n-x\n+y\n")


def test_cli_reports_a_corpus_patch_and_refuses_a_bad_one(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvspec.cli", "check", "--target", "vllm", "--patch",
                        str(CORPUS / "evict_keeps_hash.diff"), "--level", "pool", "--json", "--max-examples", "2000",
                        "--seed", "1", "--report-dir", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 1, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["verdict"] == "violation" and d["violations"][0]["invariant"] == "I4"
    bad = tmp_path / "bad.diff"
    bad.write_text((CORPUS / "evict_keeps_hash.diff").read_text().replace("self._maybe_evict", "self._maybe_keep"))
    r = subprocess.run([sys.executable, "-m", "kvspec.cli", "check", "--target", "vllm", "--patch", str(bad)],
                       capture_output=True, text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "block_pool.py: hunk '@@" in lines[0]
