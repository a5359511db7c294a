"""The nano-vllm-voxcpm rows of reports/upstream-findings.md, checked through voxcpm's own
scheduler at the engine level (``kvspec check --level engine``).

voxcpm admits a wholly cached prompt without prefilling it; its next decode step recomputes
the last prompt token in place, in a slot the admission already holds (``may_append``
allocates nothing). The engine's SLOTS check must count that position as having room, or the
fixed release fails on a false alarm and the report's "fix passes" claim is untrue.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VOXCPM_FIX = ROOT / "reports" / "upstream_fixes" / "nanovllm_voxcpm_stale_index.diff"
TARGET = "nanovllm:nanovllm_voxcpm"

pytestmark = [
    pytest.mark.upstream,
    pytest.mark.skipif(importlib.util.find_spec("nanovllm_voxcpm") is None,
                       reason="nano-vllm-voxcpm is not installed: pip install --no-deps -r requirements/upstream.txt"),
]


def test_whole_prompt_hit_decoded_in_place_is_not_a_slots_violation():
    """The shrunk false alarm: r2's prompt is wholly cached (r1 computed it), so one engine
    step admits r2 and decodes its last prompt token in the admission's slot."""
    from kvspec.check.session import run_steps
    from kvspec.spec.config import Config
    from kvspec.spec.ops import Arrive, EngineStep
    from kvspec.targets.registry import load_target

    steps = [Arrive(req="r1", prompt=(11, 12, 2, 2), max_tokens=2), EngineStep(token=3),
             Arrive(req="r2", prompt=(11, 12, 2, 2)), EngineStep(token=4), EngineStep(token=5)]
    config = Config(level="engine", num_blocks=14, block_size=4, caching=True)
    out = run_steps(load_target(TARGET, patch=str(VOXCPM_FIX)), config, steps)
    assert not out.failed, [v.message for v in out.violations]


def test_voxcpm_release_finds_its_stale_index_and_the_fix_passes(tmp_path):
    """`kvspec check --target nanovllm:nanovllm_voxcpm --level engine --max-examples 100 --seed 0`:
    the release fails INDEX_CONSISTENT (nano-vllm#163) through its own scheduler; with
    reports/upstream_fixes/nanovllm_voxcpm_stale_index.diff it passes."""
    from kvspec.check.search import run_check
    from kvspec.targets.registry import load_target

    report = run_check(load_target(TARGET), TARGET, level="engine", seed=0, max_examples=100,
                       report_dir=str(tmp_path))
    assert report.violations, "voxcpm's stale index entry is not reached in 100 examples"
    assert report.violations[0].invariant == "INDEX_CONSISTENT", report.violations[0].to_dict()

    fixed = run_check(load_target(TARGET, patch=str(VOXCPM_FIX)), TARGET, level="engine", seed=0,
                      max_examples=100, report_dir=str(tmp_path), patch=str(VOXCPM_FIX),
                      patch_text=VOXCPM_FIX.read_text())
    assert fixed.verdict == "pass", [v.to_dict()["message"] for v in fixed.violations]
    assert fixed.examples >= 100
