"""The model checker over the cache features (issue 11): KV-cache groups, chunked
prefill, drafts and verification, extra keys, connector tokens and the
``max_model_len`` cap.

* ``enabled_cache_ops`` lists the new ops only where the model has the features, and
  leaves the plain cache level as it was;
* the canonical key tells apart states that differ only in that new state (extra keys,
  drafts in flight), and still merges requests that are renamings of each other;
* ``kvspec mc --kv-groups full,swa:4`` finds each of impl's eight feature bugs on small
  bounds, its counterexample replays, and no shorter one exists in mc's domains; the
  unpatched impl passes on the same bounds;
* ``kvspec check`` reports each of them at exactly mc's shortest length, proven;
* the same mc run finds vLLM 0.33.0's hybrid corpus diffs (those with a ``kv_groups``)
  and passes on the unmodified vLLM.
"""
import json
from pathlib import Path

import pytest

from kvspec.check.search import run_check
from kvspec.check.session import Session
from kvspec.mc.canonical import state_key
from kvspec.mc.enumerate_ops import Bounds, enabled_cache_ops
from kvspec.mc.search import confirm, model_check
from kvspec.spec.config import Config
from kvspec.spec.model import CacheModel
from kvspec.spec.ops import Admit, Prefill, Step, Verify
from kvspec.targets import load_target
from kvspec.targets.base import Traits

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"
FEATURE_BUGS = ["hybrid_hit_not_truncated", "swa_free_off_by_one", "lora_not_hashed", "lookahead_no_slots",
                "drafts_cached", "external_behind_window", "max_model_len_ignored", "chunk_caches_uncomputed"]
GROUPS = "full,swa:4"
USABLE = 6          # the smallest pool on which a 3-block request fits in both groups
DEPTH = 2           # every one of the eight has a counterexample this short in mc's domains


def _config(target, bug: str = "") -> Config:
    # The cap is a property of the configuration; 4 tokens is below mc's longest prompt.
    return Config(level="cache", num_blocks=USABLE + (1 if target.traits.null_block else 0), block_size=2,
                  kv_groups=GROUPS, max_model_len=4 if bug == "max_model_len_ignored" else None)


def test_feature_bugs_are_in_the_corpus():
    ids = {b["id"] for b in json.loads((CORPUS / "bugs.json").read_text())}
    assert set(FEATURE_BUGS) <= ids


def test_enumeration_has_the_feature_ops_only_with_features():
    impl = load_target("impl")
    s = Session(impl, _config(impl))
    ops = enabled_cache_ops(s.model, s.config, Bounds())
    admits = [o for o in ops if isinstance(o, Admit)]
    assert any(o.chunk for o in admits) and any(o.external for o in admits)
    assert {o.extra for o in admits} >= {None, "lora:A", "salt:s"}
    s.apply(Admit("r1", (1, 2, 11, 12), chunk=2))
    assert Prefill("r1", 2) in enabled_cache_ops(s.model, s.config, Bounds(), next_request=2)
    assert not any(isinstance(o, Step) for o in enabled_cache_ops(s.model, s.config, Bounds(), next_request=2))
    s.apply(Prefill("r1", 2))
    steps = [o for o in enabled_cache_ops(s.model, s.config, Bounds(), next_request=2) if isinstance(o, Step)]
    assert {len(o.drafts) for o in steps} == {0, 1, 2}
    s.apply(Step("r1", 11, (11,)))   # two drafts would not fit in the pool: refused
    assert [o for o in enabled_cache_ops(s.model, s.config, Bounds(), next_request=2)
            if isinstance(o, Verify)] == [Verify("r1", 0), Verify("r1", 1)]
    # impl on the plain configuration: off unless asked for (the old, smaller state space)
    full = Session(impl, Config(level="cache", num_blocks=5, block_size=2))
    assert not any(o.chunk or o.extra or o.external for o in enabled_cache_ops(full.model, full.config, Bounds())
                   if isinstance(o, Admit))
    assert any(o.extra for o in enabled_cache_ops(full.model, full.config, Bounds(features=True))
               if isinstance(o, Admit))
    # a plain cache model: the old vocabulary, unchanged
    plain = CacheModel(Config(level="cache", num_blocks=5, block_size=2), Traits())
    old = enabled_cache_ops(plain, Config(level="cache", num_blocks=5, block_size=2), Bounds())
    assert old and all(isinstance(o, Admit) and o.chunk is None and o.extra is None and o.external == 0
                       for o in old)


def _key_after(target, ops):
    s = Session(target, _config(target))
    for op in ops:
        s.apply(op)
    lens = {op.req: len(op.prompt) for op in ops if isinstance(op, Admit) and op.prompt is not None}
    return state_key(s, {"prompt_lens": lens})


def test_canonical_key_keeps_extra_keys_and_drafts():
    impl = load_target("impl")
    a = (1, 2, 11)
    # extra keys: same tokens, tables and blocks, different sharing rights
    assert _key_after(impl, [Admit("r1", a)]) != _key_after(impl, [Admit("r1", a, extra="lora:A")])
    # drafts in flight: same tokens, computed count, tables and slots; only the draft differs
    assert _key_after(impl, [Admit("r1", a), Step("r1", 12, (11,))]) != \
        _key_after(impl, [Admit("r1", a), Step("r1", 12, (12,))])
    # renaming requests still merges: r1 plain + r2 lora == r1 lora + r2 plain
    a = (1, 2)   # one block per group, so that both requests fit the pool
    k1 = _key_after(impl, [Admit("r1", a), Admit("r2", a, extra="lora:A")])
    k2 = _key_after(impl, [Admit("r1", a, extra="lora:A"), Admit("r2", a)])
    assert k1 == k2


def test_unpatched_impl_passes_on_the_same_bounds():
    impl = load_target("impl")
    r = model_check(impl, _config(impl), DEPTH, Bounds(), time_cap=float("inf"))
    assert r.verdict == "pass", r.reason


@pytest.mark.parametrize("bug", FEATURE_BUGS)
def test_mc_finds_feature_bug_at_its_shortest(bug):
    target = load_target("impl", patch=str(CORPUS / f"{bug}.diff"))
    cfg = _config(target, bug)
    r = model_check(target, cfg, DEPTH, Bounds(), time_cap=float("inf"))
    assert r.verdict == "violation" and r.counterexample is not None, bug
    assert confirm(target, cfg, r), bug
    n = len(r.counterexample)
    if n > 1:  # nothing shorter fails with that invariant, a completed search says so
        shorter = model_check(target, cfg, n - 1, Bounds(), time_cap=float("inf"), invariant=r.violations[0].invariant)
        assert shorter.verdict == "pass", (bug, shorter.verdict)


@pytest.mark.parametrize("bug", FEATURE_BUGS)
def test_check_reports_mc_shortest_length_for_feature_bug(bug, tmp_path):
    path = str(CORPUS / f"{bug}.diff")
    target = load_target("impl", patch=path)
    report = run_check(target, "impl", patch=path, patch_text=Path(path).read_text(), level="cache", seed=1,
                       max_examples=1000, report_dir=str(tmp_path), kv_groups=GROUPS)
    assert report.violations, bug
    f = report.violations[0]
    assert f.minimal is True, (bug, f.steps, f.config)
    # mc on the configuration of check's repro, over the domains the minimizer's proof is
    # over (mc's own, widened by the repro's arguments): the same invariant, nothing shorter
    bounds = Bounds().widened(f.steps, f.config)
    assert model_check(target, f.config, len(f.steps), bounds, invariant=f.invariant,
                       time_cap=float("inf")).verdict == "violation"
    if len(f.steps) > 1:
        assert model_check(target, f.config, len(f.steps) - 1, bounds, invariant=f.invariant,
                           time_cap=float("inf")).verdict == "pass"


# -- vLLM 0.33.0: the hybrid corpus (diffs with a kv_groups of their own) ------------------
VLLM_CORPUS = CORPUS.parent / "vllm"
VLLM_HYBRID = [b for b in json.loads((VLLM_CORPUS / "bugs.json").read_text())
               if b.get("kv_groups") and b.get("kind") == "safety"] if (VLLM_CORPUS / "bugs.json").is_file() else []


def _vllm(patch=None):
    try:
        return load_target("vllm", patch=patch)
    except Exception as e:  # vllm not installed here
        pytest.skip(f"vllm 0.33.0 cannot be loaded: {e}")


@pytest.mark.slow   # about 20 s on a loaded machine (vLLM's import, a deep-copy fork per state)
def test_unpatched_vllm_passes_on_hybrid_bounds():
    t = _vllm()
    cfg = Config(level="cache", num_blocks=USABLE + (1 if t.traits.null_block else 0), block_size=2, kv_groups=GROUPS)
    r = model_check(t, cfg, DEPTH, Bounds(), time_cap=float("inf"))
    assert r.verdict == "pass", r.reason


@pytest.mark.parametrize("bug", VLLM_HYBRID, ids=[b["id"] for b in VLLM_HYBRID])
def test_mc_finds_vllm_hybrid_bug_at_its_shortest(bug):
    t = _vllm(str(VLLM_CORPUS / bug["file"]))
    cfg = Config(level="cache", num_blocks=USABLE + (1 if t.traits.null_block else 0), block_size=2,
                 kv_groups=bug["kv_groups"])
    r = model_check(t, cfg, DEPTH, Bounds(), time_cap=float("inf"))
    assert r.verdict == "violation" and r.counterexample is not None, bug["id"]
    assert confirm(t, cfg, r), bug["id"]
    n = len(r.counterexample)
    if n > 1:
        shorter = model_check(t, cfg, n - 1, Bounds(), time_cap=float("inf"), invariant=r.violations[0].invariant)
        assert shorter.verdict == "pass", (bug["id"], shorter.verdict)
