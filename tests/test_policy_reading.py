"""Policies read from a package's own code (issue 36, kvspec.targets.nano_reading): where the
code settles a policy, kvspec checks the engine against it instead of reporting the engine's
choice as a finding; where the code shows the choice is not handled, the finding is a bug and
says why. Each reading on managers and model runners written here (from
examples/my_block_manager.py), never on a fork's code; no search, only fixed steps."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvspec.check.hints import label
from kvspec.check.search import Finding
from kvspec.check.session import run_steps
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit
from kvspec.targets.nano_reading import READ_MARK, read_whole_prompt
from kvspec.targets.registry import load_target

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "examples" / "my_block_manager.py").read_text()
STRICT = ROOT / "examples" / "my_block_manager_strict.py"
NEVER_WHOLE = "        for i in range((len(seq) - 1) // self.block_size):\n"
# the same manager, except that a hit may cover the whole prompt (its last block too)
WHOLE_HITS = EXAMPLE.replace(NEVER_WHOLE, "        for i in range(len(seq) // self.block_size):\n")

UNGUARDED = '''
class ModelRunner:
    def prepare_prefill(self, seqs):
        input_ids = []
        for seq in seqs:
            input_ids.extend(seq[seq.num_cached_tokens:])
        return input_ids
'''
DECODE_ROW = '''
class ModelRunner:
    def prepare(self, seqs):
        input_ids = []
        for seq in seqs:
            start = seq.num_cached_tokens
            if start < seq.num_prompt_tokens:
                input_ids.extend(seq[start:])
            else:                      # a fully cached row recomputes its last token, as a decode row
                input_ids.append(seq.last_token)
        return input_ids
'''
# the guard without the decode branch: a fully cached row is fed nothing
GUARD_ONLY = DECODE_ROW.replace('''            else:                      # a fully cached row recomputes its last token, as a decode row
                input_ids.append(seq.last_token)
''', "")
# a planner that keeps the last prompt token to compute: the runner's slice is never empty
LOWERS = '''
def plan(seq):
    seq.num_cached_tokens = min(seq.num_cached_tokens, len(seq) - 1)
'''
NO_RUNNER = "X = 1\n"
BS = 2
WHOLE = [Admit("r1", (1, 2, 3, 4)), Admit("r2", (1, 2, 3, 4))]  # r2 hits both of r1's blocks: the whole prompt


def _package(tmp_path: Path, name: str, runner: str, manager: str = WHOLE_HITS, extra: str = "") -> Path:
    """``name/engine/{block_manager,model_runner}.py`` (a package name per test: modules stay imported)."""
    eng = tmp_path / name / "engine"
    eng.mkdir(parents=True)
    (tmp_path / name / "__init__.py").write_text("")
    (eng / "__init__.py").write_text("")
    (eng / "block_manager.py").write_text(manager)
    (eng / "model_runner.py").write_text(runner)
    if extra:
        (eng / "planner.py").write_text(extra)
    return eng / "block_manager.py"


@pytest.fixture(autouse=True)
def _restore_path():
    path = list(sys.path)
    yield
    sys.path[:] = path


def _config() -> Config:
    return Config(level="cache", num_blocks=4, block_size=BS, caching=True)


def test_the_templates_differ_as_intended():
    assert WHOLE_HITS != EXAMPLE and GUARD_ONLY != DECODE_ROW


# -- whole-prompt hits -------------------------------------------------------------------
def test_an_unguarded_query_slice_reads_a_whole_prompt_hit_as_a_bug(tmp_path):
    r = read_whole_prompt(_package(tmp_path, "wp_read_bug", UNGUARDED))
    assert r is not None and r.key == "whole_prompt_hits" and r.value is False
    assert "model_runner.py:6 (prepare_prefill)" in r.why and "seq[seq.num_cached_tokens:]" in r.why


def test_a_guard_with_a_decode_row_reads_whole_prompt_hits_as_handled(tmp_path):
    r = read_whole_prompt(_package(tmp_path, "wp_read_decode", DECODE_ROW))
    assert r is not None and r.value is True and "model_runner.py:8 (prepare)" in r.why


def test_a_guard_without_a_decode_row_is_still_a_bug(tmp_path):
    r = read_whole_prompt(_package(tmp_path, "wp_read_guard", GUARD_ONLY))
    assert r is not None and r.value is False


def test_code_that_lowers_the_cached_count_leaves_the_policy_open(tmp_path):
    assert read_whole_prompt(_package(tmp_path, "wp_read_lower", UNGUARDED, extra=LOWERS)) is None
    assert read_whole_prompt(_package(tmp_path, "wp_read_none", NO_RUNNER)) is None  # no runner: nothing read


def test_a_whole_prompt_hit_under_an_unguarded_runner_is_a_bug_that_says_why(tmp_path):
    t = load_target(f"{_package(tmp_path, 'wp_load_bug', UNGUARDED)}:BlockManager")
    assert t.traits.whole_prompt_hits is False and "whole_prompt_hits" not in t.traits.hintable
    assert READ_MARK + "whole_prompt_hits = false (model_runner.py:6" in t.traits.declaration
    out = run_steps(t, _config(), WHOLE)
    assert out.failed and out.invariant == "MAX_HIT"
    f = Finding("violation", "cache", _config(), WHOLE, [], 2)
    f.violations = out.violations
    label(t, f)
    assert f.label == "bug" and not f.hints   # no hint: the code settles it
    assert f.disproved.startswith("`whole_prompt_hits = true` passes this repro, but kvspec read "
                                  "whole_prompt_hits = false from your code: model_runner.py:6")


def test_a_whole_prompt_hit_under_a_decode_row_runner_is_the_engine_s_policy(tmp_path):
    t = load_target(f"{_package(tmp_path, 'wp_load_decode', DECODE_ROW)}:BlockManager")
    assert t.traits.whole_prompt_hits is True and "whole_prompt_hits" not in t.traits.hintable
    assert "whole_prompt_hits = true (model_runner.py:8" in t.traits.declaration
    assert not run_steps(t, _config(), WHOLE).failed
    # the same manager with nothing read (no runner): vLLM's rule, and the hint stays open
    t = load_target(f"{_package(tmp_path, 'wp_load_open', NO_RUNNER)}:BlockManager")
    assert "whole_prompt_hits" in t.traits.hintable and run_steps(t, _config(), WHOLE).invariant == "MAX_HIT"


# -- admission -----------------------------------------------------------------------------
def test_a_gate_that_reads_no_hash_is_read_as_admitting_all_blocks_at_the_cache_level():
    t = load_target(f"{STRICT}:BlockManager")
    assert t.traits.admit_all_blocks is True and "admit_all_blocks" not in t.traits.hintable
    assert t.traits.declaration == ("none: vLLM's defaults; " + READ_MARK + "admit_all_blocks = true (BlockManager."
                                    "can_allocate reads no hash, so it counts every block of the prompt, cached ones too)")
    # the README's strict example's NO_LEAK steps: the model now admits as the engine does
    steps = [Admit("r1", (1, 2, 3, 4)), Admit("r2", (1, 2, 3, 4, 11))]
    assert not run_steps(t, Config(level="cache", num_blocks=3, block_size=BS, caching=True), steps).failed


def test_a_gate_that_counts_hits_or_a_declared_admission_is_not_read(tmp_path):
    t = load_target(f"{ROOT / 'examples' / 'my_block_manager.py'}:BlockManager")
    assert not t.traits.admit_all_blocks and "admit_all_blocks" in t.traits.hintable and READ_MARK not in t.traits.declaration
    d = tmp_path / "declared"
    d.mkdir()
    (d / "strict_declared.py").write_text(STRICT.read_text())
    (d / "pyproject.toml").write_text("[tool.kvspec]\nadmit_all_blocks = false\n")
    t = load_target(f"{d / 'strict_declared.py'}:BlockManager")
    assert not t.traits.admit_all_blocks and READ_MARK not in t.traits.declaration  # declared: never read over


# -- the engine level: the same reading, through a scheduler of our own ------------------------
def test_the_engine_level_reports_a_whole_prompt_hit_under_an_unguarded_runner_as_a_bug(tmp_path):
    """tests/data/nano_engine/nanoshapes (written for kvspec), with its manager letting a hit cover
    the whole prompt and a model runner that computes ``seq[num_cached_tokens:]``."""
    import shutil
    from kvspec.spec.ops import Arrive, EngineStep
    src = ROOT / "tests" / "data" / "nano_engine" / "nanoshapes"
    pkg = tmp_path / "wp_engine"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for f in pkg.rglob("*.py"):
        f.write_text(f.read_text().replace("nanoshapes", "wp_engine"))
    bm = pkg / "engine" / "block_manager.py"
    never_whole = " if full and (i + 1) * self.block_size < len(seq) else None"
    assert never_whole in bm.read_text()
    bm.write_text(bm.read_text().replace(never_whole, " if full else None"))
    (pkg / "engine" / "model_runner.py").write_text(UNGUARDED.replace("for seq in seqs:", "for seq, _ in seqs:"))
    t = load_target(f"{bm}:BlockManager")
    assert t.traits.whole_prompt_hits is False and "whole_prompt_hits" not in t.traits.hintable
    cfg = Config(level="engine", num_blocks=5, block_size=BS, caching=True)
    steps = [Arrive("r1", (1, 2, 3, 4), 1), EngineStep(token=3), Arrive("r2", (1, 2, 3, 4), 2), EngineStep(token=3)]
    out = run_steps(t, cfg, steps)
    assert out.failed and out.invariant == "MAX_HIT" and out.index == 3, out
    f = Finding("violation", "engine", cfg, steps, [], 3)
    f.violations = out.violations
    label(t, f)
    assert f.label == "bug" and "kvspec read whole_prompt_hits = false from your code: model_runner.py:6" in f.disproved
