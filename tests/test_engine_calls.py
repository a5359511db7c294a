"""The engine level on someone else's scheduler (issue 36): every call the scheduler makes
into its manager is recorded and read from the method's own code, hashes become visible
when the engine publishes them, arguments are read by meaning, and schedule()'s return
shape is checked before the first step.

Two packages written for these tests (tests/data/nano_engine):
- nanomixed: admits with ``allocate_and_hash(seq, n)``, grows with
  ``allocate_incremental(seq, chunk)``, mixes prefill chunks and decodes in one batch, and
  its ``schedule()`` returns a dataclass with a ``.sequences`` field;
- nanolate: admits with ``allocate(seq, num_cached_blocks)`` and publishes the hashes of
  the blocks a step filled in ``postprocess`` (``commit_hashes``), after the forward pass.
Each has a planted real bug beside it: a decode row whose block comes only after the
forward pass.
"""
from __future__ import annotations

import random
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

import pytest

from kvspec.engine.nano_engine import NanoEngineDriver, load_file_engine
from kvspec.errors import TargetError

DATA = Path(__file__).parent / "data" / "nano_engine"
MIXED = DATA / "nanomixed" / "engine" / "block_manager.py"
LATE = DATA / "nanolate" / "engine" / "block_manager.py"
MIXED_BUG = DATA / "mixed_decode_block_after_forward.diff"
LATE_BUG = DATA / "late_decode_block_after_forward.diff"
TINY = DATA / "nanotiny"
BS = 2


def _program(rng: random.Random, max_len: int, n_ops: int = 14) -> list[tuple]:
    """Arrivals over a two-token alphabet (shared prefixes) and engine steps."""
    ops, n = [], 0
    for _ in range(n_ops):
        if rng.random() < 0.35 and n < 4:
            prompt = tuple(rng.choice((1, 2)) for _ in range(rng.randint(1, min(3 * BS, max_len - 1))))
            ops.append(("arrive", f"r{n}", prompt, rng.randint(1, min(3, max_len - len(prompt)))))
            n += 1
        else:
            ops.append(("step", rng.choice((1, 2))))
    return ops


def session_search(manager: Path, patch: Optional[Path], examples: int, blocks: int = 5, seed: int = 0):
    """(the first finding, the index of the event that raised it, its ops) over ``examples``
    seeded programs through the engine-level session (the whole catalogue), or (None, None, None)."""
    from kvspec.check.session import Session
    from kvspec.engine.session import EngineSession
    from kvspec.spec.config import Config
    from kvspec.spec.ops import Arrive, EngineStep
    from kvspec.targets.user_target import load_user_target

    target = load_user_target(f"{manager}:BlockManager")
    target.patch_text = patch.read_text() if patch else None
    rng = random.Random(seed)
    for _ in range(examples):
        prog = _program(rng, blocks * BS)
        s = Session(target, Config(level="engine", num_blocks=blocks, block_size=BS, caching=True))
        assert isinstance(s, EngineSession)
        ops = [Arrive(o[1], o[2], o[3]) if o[0] == "arrive" else EngineStep(token=o[1]) for o in prog]
        for k, op in enumerate(ops + [EngineStep(token=3)] * 30):
            found = s.apply(op)
            if found:
                return found[0], k, ops[:k + 1] if k < len(ops) else ops + [EngineStep(token=3)] * (k + 1 - len(ops))
            if isinstance(op, EngineStep) and s.engine.sched.is_finished() and k >= len(ops):
                break
    return None, None, None


def _calls(drv: NanoEngineDriver) -> list[tuple]:
    return [(c.kind, c.req, c.new, c.hit, c.ok, c.published) for c in drv.manager_calls()]


def _room(calls: list[tuple]) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, req, new, _, ok, _ in calls:
        if ok and kind in ("admit", "grow"):
            out[req] = out.get(req, 0) + new
    return out


# -- misreading 1: admission and growth under names of the manager's own ------------------------
def test_allocate_and_hash_and_allocate_incremental_are_recorded_as_admission_and_growth():
    """Every scheduled token was given room by a recorded call (kvspec used to record only
    allocate/may_append and report 'asked the KV manager for room for only 0')."""
    drv = NanoEngineDriver(load_file_engine(MIXED), 6, BS)
    drv.arrive("a", (1, 2, 1, 2, 1), 2)
    drv.arrive("b", (1, 2, 1, 2), 2)
    seen_kinds = set()
    for _ in range(6):
        f = drv.step(lambda r, p: 9)
        calls = _calls(drv)
        seen_kinds |= {c[0] for c in calls}
        assert _room(calls) == f.scheduled, (calls, f)
        assert all(len(f.slots[r]) == n for r, n in f.scheduled.items())
    assert {"admit", "grow", "finish"} <= seen_kinds


# -- misreading 2: hashes published in postprocess ------------------------------------------------
def test_hashes_published_in_postprocess_are_a_publication_of_their_own():
    """nanolate hashes a prompt's full blocks only in postprocess: the admission carries
    what was visible then (nothing), and the hashes arrive as a 'publish' call."""
    drv = NanoEngineDriver(load_file_engine(LATE), 6, BS)
    drv.arrive("a", (1, 2, 1, 2, 1), 2)
    drv.step(lambda r, p: 9)
    calls = _calls(drv)
    admit = next(c for c in calls if c[0] == "admit")
    publish = [c for c in calls if c[0] == "publish"]
    assert admit[5] == 0, calls
    assert publish and publish[-1][5] == (5 // BS) * BS, calls


def test_late_publication_engine_has_no_false_finding():
    v, k, ops = session_search(LATE, None, 30)
    assert v is None, (v, ops)
    v, k, ops = session_search(LATE, None, 30, blocks=3, seed=1)
    assert v is None, (v, ops)


# -- misreading 3: allocate(seq, num_cached_blocks) -------------------------------------------------
def test_num_cached_blocks_is_a_hit_not_a_number_of_new_tokens():
    """b shares a's first full block: allocate(seq, 1) is a hit of one block; the new tokens are
    the rest of b's prompt (kvspec used to read the 1 as one new token)."""
    drv = NanoEngineDriver(load_file_engine(LATE), 8, BS)
    drv.arrive("a", (1, 2, 1), 3)
    drv.step(lambda r, p: 9)
    drv.manager_calls()
    drv.arrive("b", (1, 2, 2, 2, 1), 2)
    f = drv.step(lambda r, p: 9)
    admit = next(c for c in _calls(drv) if c[0] == "admit" and c[1] == "b")
    cached = drv.seqs["b"].num_cached_tokens
    assert cached == BS  # one block, read off the Sequence the manager filled in
    assert admit[3] == cached and admit[2] == f.scheduled["b"] == 5 - cached, admit


# -- misreading 4: schedule() returning a dataclass -----------------------------------------------
def test_schedule_returning_a_dataclass_with_sequences_is_read():
    drv = NanoEngineDriver(load_file_engine(MIXED), 6, BS)
    drv.arrive("a", (1, 2, 1), 2)
    f = drv.step(lambda r, p: 9)
    assert f.scheduled == {"a": 3} and f.start == {"a": 0}
    assert drv.tokens()["a"] == (1, 2, 1, 9)  # postprocess got the batch object and appended


def _copy(pkg: str, tmp: Path) -> Path:
    """A copy of a test package under a name of its own (a package already imported under its
    name would be found again instead of the copy)."""
    name = f"{pkg}_{re.sub(r'[^0-9A-Za-z_]', '_', tmp.name)}"
    shutil.copytree(DATA / pkg, tmp / name)
    for f in (tmp / name).rglob("*.py"):
        f.write_text(f.read_text().replace(pkg, name))
    return tmp / name / "engine"


@pytest.mark.parametrize("ret", ["{'seqs': out.sequences}", "Plan(out.sequences)"])
def test_a_schedule_shape_kvspec_cannot_read_is_refused_before_the_first_step(tmp_path, ret):
    eng = _copy("nanomixed", tmp_path)
    src = (eng / "scheduler.py").read_text()
    src = src.replace("        return out\n", f"        return {ret}\n")
    src += "\n\nclass Plan:\n    def __init__(self, rows):\n        self.rows = rows\n"
    (eng / "scheduler.py").write_text(src)
    with pytest.raises(TargetError, match=r"^target .*schedule\(\) returns"):
        NanoEngineDriver(load_file_engine(eng / "block_manager.py"), 6, BS)


def test_the_correct_mixed_engine_has_no_false_finding():
    v, k, ops = session_search(MIXED, None, 30)
    assert v is None, (v, ops)
    v, k, ops = session_search(MIXED, None, 30, blocks=3, seed=1)
    assert v is None, (v, ops)


# -- real engine bugs stay findable ------------------------------------------------------------------
@pytest.mark.parametrize("manager,bug", [(MIXED, MIXED_BUG), (LATE, LATE_BUG)], ids=["mixed", "late"])
def test_a_decode_block_allocated_after_the_forward_pass_is_found_at_its_step(manager, bug):
    """The planted bug: a decode row's block comes only in postprocess. Found as SLOTS, at the
    step whose decode token opens a new block (its KV had nowhere to go but a full block)."""
    v, k, ops = session_search(manager, bug, 30)
    assert v is not None and v.invariant == "SLOTS", (v, ops)
    assert "but only 0 of them have a slot" in v.message, v.message
    pos = int(v.message.split("from position ")[1].split(",")[0])
    assert pos % BS == 0  # the token opens a block
    # the same events on the correct engine raise nothing: the finding is the bug's
    from kvspec.check.session import Session
    from kvspec.spec.config import Config
    from kvspec.targets.user_target import load_user_target
    s = Session(load_user_target(f"{manager}:BlockManager"), Config(level="engine", num_blocks=5, block_size=BS,
                                                                     caching=True))
    assert not any(s.apply(op) for op in ops)


def test_check_level_engine_finds_the_planted_bug_and_passes_the_fix(tmp_path):
    """`kvspec check FILE --level engine --max-examples N` on nanomixed: a pass; with the bug
    diff, findings of that bug only, with engine events as their steps."""
    from kvspec.check.search import run_check
    from kvspec.targets.registry import load_target

    spec = f"{MIXED}:BlockManager"
    report = run_check(load_target(spec), spec, level="engine", seed=0, max_examples=30, report_dir=str(tmp_path))
    assert report.verdict == "pass", [v.to_dict()["message"] for v in report.violations]
    report = run_check(load_target(spec, patch=str(MIXED_BUG)), spec, level="engine", seed=0, max_examples=60,
                       report_dir=str(tmp_path), patch=str(MIXED_BUG), patch_text=MIXED_BUG.read_text())
    # the bug's two faces: a decode token with no slot, or the late allocation failing on an
    # empty pool (the scheduler checked for room before other rows took it); nothing else
    found = {v.invariant for v in report.violations}
    assert found and found <= {"SLOTS", "NO_CRASH"}, [(v.invariant, v.message) for v in report.violations]
    assert all(type(op).__name__ in ("Arrive", "EngineStep", "Abort") for op in report.violations[0].steps)


# -- a call kvspec cannot interpret is a refusal, never a finding -------------------------------------
def test_a_copy_on_write_remap_is_refused_in_one_line(tmp_path):
    eng = _copy("nanotiny", tmp_path)
    bm = (eng / "block_manager.py").read_text() + (
        "\n    def cow_block(self, seq, i):\n"
        "        seq.block_table[i] = self._take(self.free_block_ids[0]).block_id\n")
    (eng / "block_manager.py").write_text(bm)
    sch = (eng / "scheduler.py").read_text().replace(
        "                self.block_manager.may_append(seq)\n",
        "                self.block_manager.may_append(seq)\n                self.block_manager.cow_block(seq, 0)\n")
    (eng / "scheduler.py").write_text(sch)
    with pytest.raises(TargetError, match=r"^target .*cow_block"):
        NanoEngineDriver(load_file_engine(eng / "block_manager.py"), 5, BS)


# -- issue 35.3: declared names hold at the engine level ----------------------------------------------
def _renamed_tiny(tmp_path: Path) -> Path:
    eng = _copy("nanotiny", tmp_path)
    for f in ("block_manager.py", "scheduler.py"):
        p = eng / f
        p.write_text(p.read_text().replace("deallocate(", "release_sequence("))
    return eng / "block_manager.py"


@pytest.mark.parametrize("how", ["pyproject", "class_attribute"])
def test_renamed_deallocate_with_declared_names_runs_at_the_engine_level(tmp_path, how):
    from kvspec.check.search import run_check
    from kvspec.targets.registry import load_target

    bm = _renamed_tiny(tmp_path)
    if how == "pyproject":
        (tmp_path / "pyproject.toml").write_text('[tool.kvspec.names]\ndeallocate = "release_sequence"\n')
    else:
        text = bm.read_text().replace("class BlockManager:\n",
                                      "class BlockManager:\n    kvspec_names = {\"deallocate\": \"release_sequence\"}\n")
        bm.write_text(text)
    spec = f"{bm}:BlockManager"
    target = load_target(spec)
    assert target.names.resolve(target.manager_cls, "deallocate") == "release_sequence"
    report = run_check(target, spec, level="engine", seed=0, max_examples=20, report_dir=str(tmp_path / "r"))
    assert report.verdict == "pass", [v.to_dict()["message"] for v in report.violations]
    assert report.examples >= 20


def test_an_engine_level_load_error_names_its_target(tmp_path):
    """A declaration naming a method the class lacks: one line, with the usual prefix."""
    from kvspec.engine.nano_engine import engine_driver_for
    from kvspec.spec.config import Config
    from kvspec.targets.names import Names

    bm = _renamed_tiny(tmp_path)
    parts = load_file_engine(bm)
    with pytest.raises(Exception, match=r"^target "):
        NanoEngineDriver(parts, 5, BS, names=Names({"free_block_ids": "no_such_field"}, "pyproject.toml"))


# -- a manager with none of the cache level's calls loads for the engine level -------------------------
def test_a_manager_only_its_scheduler_drives_goes_to_the_engine_level(tmp_path):
    """nanomixed has no allocate/may_append: `kvspec check FILE` runs it through its scheduler
    (with a note), and `--level cache` is one line saying why not and what to do."""
    import json
    import subprocess

    spec = f"{MIXED}:BlockManager"
    base = [sys.executable, "-m", "kvspec", "check", "--target", spec, "--max-examples", "10", "--seed", "0",
            "--report-dir", str(tmp_path)]
    r = subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=600)
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["levels"] == ["engine"] and report["verdict"] == "pass", r.stdout + r.stderr
    assert "allocate_and_hash" in r.stderr  # the note names the call only the scheduler knows
    r = subprocess.run(base + ["--level", "cache"], capture_output=True, text=True, timeout=600)
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert errors[0].startswith("kvspec: error: target ") and "--level engine" in errors[0], errors
