"""Issue 35 point 4: a free list used as a stack (a Python list popped from the end) under
a declared ``free_order = "mru"`` is read as a stack, and the name map can say which end
is next (``free_next``) where the structure cannot."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "examples" / "my_block_manager.py").read_text()


def stack_manager(tmp_path: Path, declare: str, name: str = "stack_bm") -> str:
    """examples/my_block_manager.py with its free deque turned into a stack: a list whose
    end is reused next (pop()), block 0 popped first."""
    src = EXAMPLE.replace("self.free_block_ids: deque[int] = deque(range(num_blocks))  # front: reused first",
                          "self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # end: reused next")
    src = src.replace("self.free_block_ids.popleft()", "self.free_block_ids.pop()")
    # pushed head first, so a request's tail is on top: its freed blocks reused tail first,
    # most recently freed first (kvspec's "mru": a free call's blocks to the front)
    src = src.replace("for block_id in reversed(seq.block_table):", "for block_id in seq.block_table:")
    assert "deque(range" not in src and ".popleft()" not in src and "reversed(seq.block_table)" not in src
    src = src.replace("class BlockManager:\n", f"class BlockManager:\n{declare}", 1)
    (tmp_path / f"{name}.py").write_text(src)  # one file per declaration: a loaded file is kept
    return str(tmp_path / f"{name}.py") + ":BlockManager"


def check(spec: str, tmp_path: Path, capsys) -> dict:
    from kvspec.cli import main
    code = main(["check", "--target", spec, "--max-examples", "60", "--seed", "0", "--json",
                 "--report-dir", str(tmp_path / "out")])
    out = json.loads(capsys.readouterr().out)
    out["exit"] = code
    return out


def test_a_list_under_mru_is_read_as_a_stack(tmp_path, capsys):
    """The issue's case: reading list[0] as next gave a 0-step EVICTION_ORDER."""
    out = check(stack_manager(tmp_path, '    kvspec_traits = {"free_order": "mru"}\n'), tmp_path, capsys)
    assert out["verdict"] == "pass", [(v["invariant"], v["message"]) for v in out["violations"]]
    assert out["exit"] == 0


def test_free_next_declares_the_end(tmp_path, capsys):
    """A declared end wins over the structure: the stack declared ``free_next = "start"`` is
    read from the wrong end and the order check catches it; ``"end"`` passes."""
    wrong = check(stack_manager(tmp_path, '    kvspec_traits = {"free_order": "mru"}\n'
                                          '    kvspec_names = {"free_next": "start"}\n', "stack_start"), tmp_path, capsys)
    assert wrong["verdict"] == "violation" and wrong["violations"][0]["invariant"] == "EVICTION_ORDER"
    right = check(stack_manager(tmp_path, '    kvspec_traits = {"free_order": "mru"}\n'
                                          '    kvspec_names = {"free_next": "end"}\n', "stack_end"), tmp_path, capsys)
    assert right["verdict"] == "pass"


def test_free_next_end_rules():
    from kvspec.targets.names import Names, free_next_end, read_free_list
    assert free_next_end([1, 2], None, "mru") is True
    assert free_next_end([1, 2], None, "lru_tail_first") is False
    from collections import deque
    assert free_next_end(deque([1, 2]), None, "mru") is False  # a deque is popped from the left
    assert free_next_end(deque([1, 2]), Names({"free_next": "end"}), "fifo") is True
    assert read_free_list([3, 2, 1], next_end=True) == ([1, 2, 3], [])
    assert read_free_list([3, 2, 1, 2], truth={1, 2}, next_end=True) == ([2, 1], [])


def test_free_next_must_be_an_end():
    from kvspec.targets.names import read_names

    class M:
        kvspec_names = {"free_next": "middle"}
    with pytest.raises(UsageError, match="free_next must be one of"):
        read_names(M)
