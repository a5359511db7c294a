"""EAGLE/MTP prefix hits at the cache level (``Config.use_eagle``) and MIN_HIT, the lower
bound on hits: a hit the reference model proves every group can serve is taken.

H10 of reports/vllm-history.md: before 0.20.0 a hybrid coordinator applies EAGLE's "drop
the last matched block" more than once per candidate hit (the other groups are looked up
at the full group's already-dropped length, and 0.14.0's fixed-point loop re-applies the
drop on every retry pass, down to 0). Nothing stated caught it: MAX_HIT bounds a hit from
above only. The model's EAGLE rule is ``spec.model.groups.eagle_hit``.
"""
from __future__ import annotations

import pytest

from kvspec.spec.model.groups import Group, agreed_hit, eagle_hit
from release_trees import OLD_POLICY, replay_on

BS = 2
PROMPT = tuple(range(1, 9))   # four blocks of 2
# r1 computes and caches its four blocks in both groups; r2 is the same prompt plus one
# token, so it may hit up to 8 tokens (its last token is computed)
STEPS = "[Admit('r1', tuple(range(1, 9))), Finish('r1'), Admit('r2', tuple(range(1, 10)))]"


def _cached(blocks_per_group):
    return lambda g: (lambda i: i in blocks_per_group[g])


def test_eagle_rule_keeps_the_block_it_drops_cached():
    groups = [Group("full"), Group("swa", 2)]
    every = {0, 1, 2, 3}
    # without EAGLE all four cached blocks are a hit (8 tokens, the cap); with it the hit
    # must leave room for the block EAGLE matches and drops: L + bs <= 8 and block L/bs
    # cached, so at most 6
    assert agreed_hit(groups, _cached([every, every]), 8, BS) == 8
    assert eagle_hit(groups, _cached([every, every]), 8, BS) == 8 - BS
    # the window group lacks block 3 (the one EAGLE would match past a 6-token hit): 6 is
    # not provable, 4 is (block 2 cached in both, the window before 4 is block 1)
    assert eagle_hit(groups, _cached([every, {0, 1, 2}]), 8, BS) == 4
    # a window group needs only its window before the hit (one block at window 2, block
    # size 2) and the block after it: block 1 may be gone for a 6-token hit (blocks 2, 3)
    assert eagle_hit(groups, _cached([every, {0, 2, 3}]), 8, BS) == 6
    # without block 3, 6 is out; 4 needs block 1 (its window) and 2 needs block 1 (the
    # block it matches and drops): nothing is provable, though without EAGLE 6 is a hit
    assert eagle_hit(groups, _cached([every, {0, 2}]), 8, BS) == 0
    assert agreed_hit(groups, _cached([every, {0, 2}]), 8, BS) == 6


def test_min_hit_on_the_installed_vllm_passes_and_fails_on_a_shrunk_hit(monkeypatch):
    pytest.importorskip("vllm")
    from kvspec.check.replay import replay_outcome
    from kvspec.spec.ops import Admit, Finish

    steps = [Admit("r1", PROMPT), Finish("r1"), Admit("r2", PROMPT + (9,))]
    cfg = dict(level="cache", num_blocks=20, block_size=BS, caching=True, kv_groups="full,swa:2", use_eagle=True)
    ok = replay_outcome("vllm", cfg, steps, op_timeout=None)
    assert not ok.failed, ok.violations[0].message

    # the same coordinator made to look two blocks short (0.33.0's EAGLE lookahead reads one
    # block past the cap, so one block short changes nothing): a hit lost, as a drop applied
    # twice loses it, with tables consistent with the shorter hit. MIN_HIT must report it at
    # r2's admission
    from vllm.v1.core import kv_cache_coordinator as kcc

    inner = kcc.HybridKVCacheCoordinator.find_longest_cache_hit

    def shrunk(self, block_hashes, max_cache_hit_length, *args, **kwargs):
        return inner(self, block_hashes, max(max_cache_hit_length - 2 * BS, 0), *args, **kwargs)

    monkeypatch.setattr(kcc.HybridKVCacheCoordinator, "find_longest_cache_hit", shrunk)
    bad = replay_outcome("vllm", cfg, steps, op_timeout=None)
    assert bad.failed and bad.index == 2 and bad.invariant == "MIN_HIT", bad


CASES = f"""[
    ("eagle", dict(level="cache", num_blocks=20, block_size=2, caching=True, kv_groups="full,swa:2",
                   use_eagle=True), {STEPS}),
    ("plain", dict(level="cache", num_blocks=20, block_size=2, caching=True, kv_groups="full,swa:2"), {STEPS}),
    # the sweep's own find on 0.14.0 (tools/vllm_releases.py defaults, example 150, minimal):
    # r1 still runs; r2 may hit 1 token (block 1 cached for EAGLE to match and drop)
    ("sweep", dict(level="cache", num_blocks=7, block_size=1, caching=True, kv_groups="full,swa:2",
                   use_eagle=True), [Admit("r1", (1, 11)), Admit("r2", (1, 11, 21), chunk=1)]),
]"""


@pytest.mark.parametrize("version,lost", [("0.14.0", True), ("0.16.0", True), ("0.20.0", False)])
def test_h10_replays_on_its_releases(version, lost):
    """0.14.0 (the fixed-point loop's spiral: r2 hits nothing), 0.16.0 (a full and a window
    group: one pass, the drop applied twice, one block lost) and 0.20.0 (the fix)."""
    from kvspec.vllm.history import attribute

    out = replay_on(version, CASES, OLD_POLICY)
    assert out["plain"] is None, out["plain"]   # without EAGLE the hit is the model's
    if not lost:
        assert out["eagle"] is None and out["sweep"] is None, out
        return
    for name, at in (("eagle", 2), ("sweep", 1)):
        assert out[name] is not None, name
        index, invariant, message = out[name]
        assert (index, invariant) == (at, "MIN_HIT"), out[name]
        finding = {"invariant": invariant, "level": "cache", "message": message, "config": {"caching": True}}
        assert "H10" in attribute(version, finding, OLD_POLICY)
