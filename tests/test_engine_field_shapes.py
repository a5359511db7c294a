"""Misreadings of full public checkouts that the engine level now reads right (issue 36,
tools/field_checkouts.py, reports/field-checkouts.md), each on a package written for these
tests (tests/data/nano_engine/nanoshapes), never on a fork's code:

- ``schedule()`` returns (sequence, tokens) pairs and ``postprocess`` takes them back;
- the Scheduler is built from separate numbers, one of them passed on as the manager's pool
  size under another name (``BlockManager(num_pages, block_size)``), and takes requests
  through ``add_request``;
- a manager method binds the table to an annotated local (``table: list[int] = seq.block_table``)
  before growing it;
- an admission gate that reads no hash cannot count hits: the manager admits only when all
  the prompt's blocks are free (``admit_all_blocks``), a policy, not a leak.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvspec.engine.call_meaning import meaning
from kvspec.engine.nano_engine import NanoEngineDriver, load_file_engine
from kvspec.targets.nano_api import gate_counts_hits
from test_engine_calls import BS, session_search

DATA = Path(__file__).parent / "data" / "nano_engine"
SHAPES = DATA / "nanoshapes" / "engine" / "block_manager.py"
SHAPES_BUG = DATA / "pairs_decode_without_may_append.diff"


def test_pairs_scheduler_from_numbers_is_driven_and_reads_the_pair_counts():
    parts = load_file_engine(SHAPES)
    drv = NanoEngineDriver(parts, 6, BS)
    assert drv.add_name == "add_request"
    assert drv.sched.block_manager.block_size == BS and len(drv.sched.block_manager.blocks) == 6
    drv.arrive("r0", (1, 2, 1), 2)
    facts = drv.step(lambda req, n: 5)
    assert facts.scheduled == {"r0": 3}          # the pair's count, the whole prompt
    facts = drv.step(lambda req, n: 5)
    assert facts.scheduled == {"r0": 1} and facts.start == {"r0": 3}   # one decode token, at position 3
    kinds = [c.kind for c in drv.manager_calls()]
    assert "grow" in kinds or "finish" in kinds


def test_an_annotated_table_alias_is_read_as_a_growth():
    parts = load_file_engine(SHAPES)
    m = meaning(parts.manager_cls, "may_append", parts.seq_cls)
    assert m.grows and m.publishes and not m.remaps


def test_the_pairs_engine_has_no_false_finding():
    v, k, ops = session_search(SHAPES, None, 30)
    assert v is None, (v, ops)
    v, k, ops = session_search(SHAPES, None, 30, blocks=3, seed=1)
    assert v is None, (v, ops)


def test_a_decode_row_without_room_is_found_through_pairs():
    v, k, ops = session_search(SHAPES, SHAPES_BUG, 30)
    assert v is not None and v.invariant == "SLOTS", (v, ops)


class _BlindGate:
    def __init__(self):
        self.free = [0, 1]

    def can_allocate(self, seq) -> bool:
        return len(self.free) >= seq.num_blocks


class _SeeingGate:
    def __init__(self):
        self.free, self.hash_to_block_id = [0, 1], {}

    def can_allocate(self, seq) -> bool:
        return len(self.free) >= self._uncached(seq)

    def _uncached(self, seq) -> int:
        return sum(1 for h in seq.block_hashes if h not in self.hash_to_block_id)


class _CountGate:
    def can_allocate(self, num_tokens: int) -> bool:
        return num_tokens < 8


@pytest.mark.parametrize("cls, expected", [(_BlindGate, False), (_SeeingGate, True), (_CountGate, None)])
def test_whether_the_admission_gate_can_see_hits_is_read_from_its_code(cls, expected):
    assert gate_counts_hits(cls) is expected


def test_an_undeclared_gate_that_cannot_see_hits_is_checked_as_admitting_all_blocks_at_both_levels():
    from kvspec.check.session import Session
    from kvspec.spec.config import Config
    from kvspec.targets.user_target import load_user_target
    target = load_user_target(f"{SHAPES}:BlockManager")
    # read at load, for both levels (kvspec.targets.nano_reading; the engine level alone read it before)
    assert target.traits.admit_all_blocks is True and "admit_all_blocks" not in target.traits.hintable
    assert "read from its code: admit_all_blocks = true" in target.traits.declaration
    s = Session(target, Config(level="engine", num_blocks=5, block_size=BS, caching=True))
    assert s.traits.admit_all_blocks is True and "admit_all_blocks" not in s.traits.hintable
    assert s.model.admit_all_blocks is True


def test_an_engine_that_logs_to_stdout_keeps_json_one_object(tmp_path):
    """A scheduler whose module logs to stdout (``logging.StreamHandler(sys.stdout)`` at import,
    as a public fork does) must not break ``--json``: its lines go to the captured output."""
    import json
    import shutil
    import subprocess
    import sys

    pkg = tmp_path / "nanoshapes"
    shutil.copytree(DATA / "nanoshapes", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    sched = pkg / "engine" / "scheduler.py"
    text = sched.read_text()
    text = text.replace("from collections import deque\n", "import logging\nimport sys\nfrom collections import deque\n"
                        "\nlog = logging.getLogger(__name__)\nlog.addHandler(logging.StreamHandler(sys.stdout))\n"
                        "log.setLevel(logging.INFO)\n", 1)
    text = text.replace("    def schedule(self) -> list[tuple[Sequence, int]]:\n",
                        "    def schedule(self) -> list[tuple[Sequence, int]]:\n        log.info('scheduling now')\n"
                        "        print('a print from schedule')\n", 1)
    sched.write_text(text)
    r = subprocess.run([sys.executable, "-m", "kvspec", "check", "--target", "nanoshapes/engine/block_manager.py:BlockManager",
                        "--level", "engine", "--max-examples", "3", "--seed", "0", "--json",
                        "--report-dir", str(tmp_path / "rep")], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert "scheduling now" not in r.stdout and "a print from schedule" not in r.stdout, r.stdout[:500]
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "pass", doc.get("error") or doc.get("violations")
