"""nano-vllm derivatives through `--target nanovllm:PKG` and `module:NAME` (issue 12):
nano-vllm-voxcpm 2.0.5 (`nanovllm_voxcpm`, whose Sequence is `Sequence(seq_id, token_ids,
block_size)` and which runs a fully cached prompt as a decode step on purpose) and
nano-vllm-npu 0.0.2 (`nanovllmnpu`, whose package imports torch_npu). Their real defects,
found on the unmodified releases, and the fix diffs of reports/upstream-findings-nano.md,
which make kvspec pass. Nothing is mocked; every search is bounded by examples or depth.

Needs `pip install --no-deps -r requirements/upstream.txt`; each package's tests skip, with
that reason, when it is missing."""
import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.check.session import Session
from kvspec.mc.enumerate_ops import Bounds
from kvspec.mc.search import model_check
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Finish, Preempt, Step
from kvspec.stateful import InvariantViolation, cache_machine
from kvspec.targets.registry import load_target

pytestmark = pytest.mark.upstream
ROOT = Path(__file__).resolve().parents[2]
FIXES = ROOT / "reports" / "upstream_fixes"
MACHINE = settings(max_examples=60, stateful_step_count=40, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))
FIND = settings(MACHINE, max_examples=300, phases=(Phase.generate,))


def need(package: str, dist: str) -> None:
    # find_spec of a top-level name runs no package code (importorskip would run the
    # package's __init__: flash-attn, torch_npu)
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{dist} is not installed: pip install --no-deps -r requirements/upstream.txt")
    if importlib.util.find_spec("xxhash") is None:
        pytest.skip("the nano-vllm block managers need xxhash: pip install xxhash")


@pytest.fixture(scope="module")
def voxcpm():
    need("nanovllm_voxcpm", "nano-vllm-voxcpm 2.0.5")
    return load_target("nanovllm:nanovllm_voxcpm")


@pytest.fixture(scope="module")
def npu():
    need("nanovllmnpu", "nano-vllm-npu 0.0.2")
    return load_target("nanovllm:nanovllmnpu")


# -- nano-vllm-voxcpm ------------------------------------------------------------------------
def test_voxcpm_sequences_are_built_by_their_signature(voxcpm):
    d = voxcpm.driver(Config(level="cache", num_blocks=4, block_size=2))
    seq = d.new_seq([1, 2, 3])
    assert type(seq).__module__ == "nanovllm_voxcpm.engine.sequence"
    assert isinstance(seq.seq_id, str) and seq.block_size == 2 and seq.num_blocks == 2
    assert "nanovllm_voxcpm.llm" not in sys.modules  # the package __init__ (flash-attn) never ran


def test_voxcpm_declares_whole_prompt_hits_and_they_pass(voxcpm):
    assert voxcpm.traits.whole_prompt_hits and voxcpm.traits.admit_all_blocks and not voxcpm.traits.free_evicts
    s = Session(voxcpm, Config(level="cache", num_blocks=4, block_size=2))
    assert s.apply(Admit("r1", (1, 2))) == [] and s.apply(Admit("r2", (1, 2))) == []
    assert s.last_result == 2  # the whole prompt hit, by design: no MAX_HIT


STALE = [Admit("r1", (1, 2, 3, 4)), Finish("r1"), Admit("r2", (11, 12, 3, 4))]


def test_voxcpm_stale_hash_to_block_id_is_found(voxcpm):
    # block 1 held [3, 4] behind [1, 2]; freed, its hash_to_block_id entry stays; reused for
    # [3, 4] behind [11, 12], the stale entry now names a block whose tokens match it
    s = Session(voxcpm, Config(level="cache", num_blocks=3, block_size=2))
    found = [s.apply(op) for op in STALE]
    assert found[:2] == [[], []] and found[2] and found[2][0].invariant == "INDEX_CONSISTENT"
    # the machines find it too (as the stale index or the wrong KV it serves), never as MAX_HIT;
    # `kvspec check --target nanovllm:nanovllm_voxcpm` cuts it to 3 steps (the report's numbers)
    with pytest.raises(InvariantViolation) as e:
        run_state_machine_as_test(cache_machine(voxcpm), settings=FIND)
    assert e.value.invariant in ("INDEX_CONSISTENT", "KV_INTEGRITY") and "MAX_HIT" not in str(e.value)


def test_voxcpm_mc_shortest_counterexample(voxcpm):
    bounds = Bounds(prompts=((1, 2, 3, 4), (11, 12, 3, 4)))
    r = model_check(voxcpm, Config(level="cache", num_blocks=3, block_size=2), 4, bounds)
    assert r.verdict == "violation" and r.violations[0].invariant == "INDEX_CONSISTENT"
    assert len(r.counterexample) == 3


def test_voxcpm_fix_passes(voxcpm):
    fixed = load_target("nanovllm:nanovllm_voxcpm", patch=str(FIXES / "nanovllm_voxcpm_stale_index.diff"))
    assert fixed.traits == voxcpm.traits  # a patch keeps the release's declared policies
    machine = cache_machine(fixed)
    run_state_machine_as_test(machine, settings=MACHINE)
    assert machine.counters["steps"] > 500
    s = Session(fixed, Config(level="cache", num_blocks=3, block_size=2))
    assert all(s.apply(op) == [] for op in STALE + [Admit("r3", (1, 2, 3, 4))])


# -- nano-vllm-npu -----------------------------------------------------------------------------
def test_npu_drives(npu):
    s = Session(npu, Config(level="cache", num_blocks=5, block_size=2))
    for op in (Admit("r1", (1, 2, 3)), Step("r1", 4), Step("r1", 5), Preempt("r1"), Admit("r1"), Finish("r1")):
        assert s.apply(op) == [], op
    assert "nanovllmnpu.llm" not in sys.modules and "torch_npu" not in sys.modules


def test_npu_findings_and_fix(npu):
    s = Session(npu, Config(level="cache", num_blocks=4, block_size=2))
    assert s.apply(Admit("r1", (1, 2))) == []
    found = s.apply(Admit("r2", (1, 2)))  # upstream nano-vllm's whole-prompt hit
    assert found and found[0].invariant == "MAX_HIT"
    fixed = load_target("nanovllm:nanovllmnpu", patch=str(FIXES / "nanovllmnpu_stale_index_and_whole_prompt.diff"))
    machine = cache_machine(fixed)
    run_state_machine_as_test(machine, settings=MACHINE)
    assert machine.counters["steps"] > 500


@pytest.mark.slow
def test_module_name_paths_skip_the_gpu_only_imports():
    need("nanovllmnpu", "nano-vllm-npu 0.0.2")
    need("nanovllm_voxcpm", "nano-vllm-voxcpm 2.0.5")
    t = load_target("nanovllm_voxcpm.engine.block_manager:BlockManager")
    assert t.traits.whole_prompt_hits  # kvspec's declaration for the released package
    assert load_target("nanovllmnpu.engine.block_manager:BlockManager").api == npu_api()
    s = Session(t, Config(level="cache", num_blocks=3, block_size=2))
    found = [s.apply(op) for op in STALE]
    assert found[2] and found[2][0].invariant == "INDEX_CONSISTENT"


def npu_api() -> str:
    from kvspec.targets.nanovllm_target import BOOLEAN
    return BOOLEAN
