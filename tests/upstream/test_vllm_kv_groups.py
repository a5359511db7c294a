"""The `vllm` target with KV-cache groups (``--kv-groups``): real ``KVCacheConfig``s,
the coordinator vLLM picks for them, per-group block tables with the null block behind
the sliding window, and ``kvspec check`` on unmodified vLLM 0.33.0 (and on a vLLM with
a window off-by-one, which it must find).

Needs `pip install --no-deps -r requirements/upstream.txt`; skipped, with that reason,
when the vLLM allocator cannot be imported."""
import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.upstream
pytest.importorskip("vllm.v1.core.kv_cache_manager",
                    reason="vllm's allocator is not importable: pip install --no-deps -r requirements/upstream.txt")

from kvspec.check.session import Session  # noqa: E402
from kvspec.errors import TargetError  # noqa: E402
from kvspec.spec.config import Config  # noqa: E402
from kvspec.spec.ops import Admit, Finish, Step, Verify  # noqa: E402
from kvspec.targets.registry import load_target  # noqa: E402
from kvspec.vllm.compat import build_kv_cache_config, build_manager  # noqa: E402


@pytest.fixture(scope="module")
def vllm():
    return load_target("vllm")


# -- the config builder and the coordinator vLLM picks ----------------------------------
@pytest.mark.parametrize("spec, classes", [
    ("full", ["FullAttentionSpec"]),
    ("full,swa:4", ["FullAttentionSpec", "SlidingWindowSpec"]),
    ("full,chunked:8", ["FullAttentionSpec", "ChunkedLocalAttentionSpec"]),
    ("full,swa:4,swa:8", ["FullAttentionSpec", "SlidingWindowSpec", "SlidingWindowSpec"]),
])
def test_config_builder_gives_real_specs_in_one_pool(spec, classes):
    from vllm.v1.core import kv_cache_manager
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator, UnitaryKVCacheCoordinator

    cfg = build_kv_cache_config(spec, num_blocks=10, block_size=2)
    specs = [g.kv_cache_spec for g in cfg.kv_cache_groups]
    assert [type(s).__name__ for s in specs] == classes
    assert cfg.num_blocks == 10 and all(s.block_size == 2 for s in specs)
    for part, s in zip(spec.split(","), specs):  # window and chunk sizes come from the spec string
        if part.startswith("swa:"):
            assert s.sliding_window == int(part[4:])
        if part.startswith("chunked:"):
            assert s.attention_chunk_size == int(part[8:])
    mgr = build_manager(kv_cache_manager, cfg, block_size=2, caching=True)
    want = UnitaryKVCacheCoordinator if len(classes) == 1 else HybridKVCacheCoordinator
    assert type(mgr.coordinator) is want
    assert len(mgr.coordinator.single_type_managers) == len(classes)
    assert len(mgr.block_pool.blocks) == 10  # one pool shared by every group


def test_unsupported_groups_are_one_line_target_errors():
    with pytest.raises(TargetError, match="mamba"):
        build_kv_cache_config("full,mamba", 8, 2)
    with pytest.raises(TargetError, match="swa:0"):
        build_kv_cache_config("full,swa:0", 8, 2)


# -- a hand-written sequence: the window's blocks become the null block -----------------
def test_sliding_window_blocks_are_replaced_by_the_null_block(vllm):
    bs, window = 2, 4
    s = Session(vllm, Config(level="cache", num_blocks=16, block_size=bs, kv_groups=f"full,swa:{window}"))
    null = s.obs.null_block
    assert null == 0
    prompt = tuple(range(1, 10))  # 9 tokens: 5 blocks per group
    assert s.apply(Admit("a", prompt)) == [] and s.last_result == 0
    full, swa = s.obs.requests["a"].table, s.obs.requests["a"].groups[0]
    assert len(full) == len(swa) == 5 and null not in full + swa and not set(full) & set(swa)
    for token in (20, 21, 22):
        before = s.obs.requests["a"]
        assert s.apply(Step("a", token)) == []
        rs = s.obs.requests["a"]
        # vLLM frees what the query at the previously computed position no longer reads
        skipped = max(0, before.computed - window + 1) // bs
        assert rs.groups[0][:skipped] == (null,) * skipped
        assert null not in rs.groups[0][skipped:] and null not in rs.table
        for b in set(swa[:skipped]):  # freed, and back in the free queue
            assert s.obs.blocks[b].ref == 0 and b in s.obs.queue
    assert rs.table[:5] == full  # the full-attention group keeps every block
    # A second request with the same prompt hits the full blocks; its window group takes
    # only the cached blocks its last hit block's window reads, and null before them.
    assert s.apply(Admit("b", prompt)) == []
    hit = s.last_result
    assert hit == 8
    hb = s.obs.requests["b"]
    assert hb.table[: hit // bs] == rs.table[: hit // bs]
    reads_from = (hit - window + 1) // bs  # first block the query at `hit` reads
    assert hb.groups[0][:reads_from] == (null,) * reads_from
    assert null not in hb.groups[0][reads_from:]
    assert s.apply(Finish("a")) == [] and s.apply(Finish("b")) == []
    assert s.obs.free_count == len(s.obs.blocks) - 1  # all but the null block


def test_draft_tokens_get_slots_but_are_never_cached(vllm):
    bs = 2
    s = Session(vllm, Config(level="cache", num_blocks=16, block_size=bs, kv_groups="full,swa:4"))
    assert s.apply(Admit("a", (1, 2, 3))) == []
    assert s.apply(Step("a", 4, drafts=(5, 6, 7))) == []
    rs = s.obs.requests["a"]
    assert rs.computed == 7 and len(rs.table) == len(rs.groups[0]) == 4
    hashed = [i for i, b in enumerate(rs.table) if s.obs.blocks[b].hash is not None]
    assert hashed == [0, 1]  # tokens 1..4 are verified; blocks of drafts 5..7 are not cached
    assert s.apply(Verify("a", 1)) == [] and s.obs.requests["a"].computed == 5
    assert s.apply(Step("a", 8)) == []  # caches the block the accepted draft filled
    rs = s.obs.requests["a"]
    assert [i for i, b in enumerate(rs.table) if s.obs.blocks[b].hash is not None] == [0, 1, 2]


# -- kvspec check on vLLM: unmodified passes, a window off-by-one is found ---------------
def _check(*args: str, report_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvspec.cli", "check", "--target", "vllm", "--level", "cache",
                           "--json", "--report-dir", str(report_dir), *args], capture_output=True, text=True)


@pytest.mark.slow  # a subprocess and 100 examples: ~10 s alone
def test_cli_check_passes_on_unmodified_vllm_with_a_window_group(tmp_path):
    r = _check("--kv-groups", "full,swa:4", "--max-examples", "100", report_dir=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["verdict"] == "pass" and d["steps"] > 500


def _swa_off_by_one(tmp_path: Path) -> Path:
    """A diff against the installed vLLM: the window frees one token too many."""
    import vllm.v1.core.single_type_kv_cache_manager as stm

    rel = "vllm/v1/core/single_type_kv_cache_manager.py"
    old = Path(stm.__file__).read_text().splitlines(keepends=True)
    body = "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens,"
    at = [i for i, line in enumerate(old) if body in line]
    assert len(at) == 1, "the sliding window's get_num_skipped_tokens changed shape"
    new = list(old)
    new[at[0]] = new[at[0]].replace(" + 1 - ", " + 2 - ")
    path = tmp_path / "swa_off_by_one.diff"
    path.write_text("".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}")))
    return path


@pytest.mark.slow
def test_cli_check_finds_a_window_off_by_one(tmp_path):
    diff = _swa_off_by_one(tmp_path)
    r = _check("--kv-groups", "full,swa:4", "--max-examples", "100", "--patch", str(diff), report_dir=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["verdict"] == "violation"
    assert d["violations"][0]["invariant"] in ("WINDOW", "KV_INTEGRITY")


# -- connector tokens a chunked group never reads (a divergence found here, now followed) --
def test_connector_tokens_ending_on_an_unaligned_chunk_boundary(vllm):
    """vLLM's allocate_external_computed_blocks allocates nothing in a group that skips
    every computed token; the block holding the chunk boundary comes with the new blocks,
    after the other groups' connector blocks. The model once allocated it first."""
    s = Session(vllm, Config(level="cache", num_blocks=16, block_size=3, kv_groups="full,chunked:4"))
    # hit 0 + 4 connector tokens: the chunked group's chunk starts at 4, so it skips all 4
    assert s.apply(Admit("r1", tuple(range(1, 11)), external=4)) == []
    rs = s.obs.requests["r1"]
    assert rs.groups[0][0] == s.obs.null_block and len(rs.table) == len(rs.groups[0]) == 4
    assert max(rs.table) < min(rs.groups[0][1:])  # the full group's blocks all came first


# -- an upstream finding on vLLM 0.33.0 (see the report): unaligned chunks -------------
def test_upstream_finding_unaligned_chunk_hit_leaves_a_read_block_null(vllm):
    """ChunkedLocalAttentionManager.find_longest_cache_hit marks every block before
    ``chunk_start // block_size`` computed (null), where chunk_start is that of
    ``max_length``. With attention_chunk_size not a multiple of block_size, the hit it
    returns can end before chunk_start, and the first query after the hit then reads a
    block it left null. This test pins that behaviour: if it fails, upstream changed."""
    from vllm.v1.core import kv_cache_manager

    bs, chunk = 3, 4
    mgr = build_manager(kv_cache_manager, build_kv_cache_config(f"chunked:{chunk}", 16, bs), bs, caching=True)
    up = vllm.up
    req = up.request.Request("r", list(range(1, 11)), up.sampling, None,
                             block_hasher=up.utils.get_request_block_hasher(bs, up.hash_fn))
    blocks, hit, _ = mgr.get_computed_blocks(req)   # nothing is cached yet
    table = blocks.get_block_ids()[0]
    assert hit > 0 and hit % bs == 0 and len(table) == hit // bs
    assert set(table) == {mgr.block_pool.null_block.block_id}
    first_read = hit // chunk * chunk   # the first position the query at `hit` attends to
    assert first_read < hit               # ... which lies inside the claimed hit, in a null block
