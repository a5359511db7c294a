"""Issue 35 point 5: an observation hook does not imply a prefix cache. A manager with no
cache that reports its state through ``kvspec_observe`` is checked with caching off, and
may declare ``prefix_caching = "off"``."""
from __future__ import annotations

import json

NO_CACHE = '''
from collections import deque


class BlockManager:
    """No prefix cache: blocks, ref counts and a free deque, read through the hook.{declare}"""
{attr}
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._free = deque(range(num_blocks))

    def kvspec_observe(self) -> dict:
        return {{"blocks": [(r, None, []) for r in self._refs], "free": list(self._free), "index": {{}}}}

    def can_allocate(self, seq) -> bool:
        return len(self._free) >= seq.num_blocks

    def allocate(self, seq) -> None:
        for _ in range(seq.num_blocks):
            b = self._free.popleft()
            self._refs[b] = 1
            seq.block_table.append(b)

    def can_append(self, seq) -> bool:
        return len(self._free) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq) -> None:
        if len(seq) % self.block_size == 1:
            b = self._free.popleft()
            self._refs[b] = 1
            seq.block_table.append(b)

    def deallocate(self, seq) -> None:
        for b in reversed(seq.block_table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
        seq.num_cached_tokens = 0
        seq.block_table.clear()
'''


def _check(tmp_path, capsys, name: str, attr: str) -> tuple[int, dict]:
    from kvspec.cli import main
    (tmp_path / f"{name}.py").write_text(NO_CACHE.format(declare="", attr=attr))
    code = main(["check", "--target", f"{tmp_path / name}.py:BlockManager", "--max-examples", "60", "--seed", "0",
                 "--json", "--report-dir", str(tmp_path / "out")])
    return code, json.loads(capsys.readouterr().out)


def test_a_hook_without_a_cache_is_checked_without_caching(tmp_path, capsys):
    code, out = _check(tmp_path, capsys, "hook_nocache", "")
    assert out["verdict"] == "pass", (out.get("error"), [(v["invariant"], v["message"]) for v in out["violations"]])
    assert code == 0


def test_prefix_caching_off_is_accepted_with_a_hook(tmp_path, capsys):
    code, out = _check(tmp_path, capsys, "hook_nocache_off", '    kvspec_traits = {"prefix_caching": "off"}\n')
    assert out["verdict"] == "pass", (out.get("error"), [(v["invariant"], v["message"]) for v in out["violations"]])
    assert code == 0


def test_caching_stays_on_where_the_manager_has_an_index():
    """The other side: a manager with an index (examples/my_block_manager.py) still caches."""
    from pathlib import Path
    from kvspec.targets import load_target
    t = load_target(str(Path(__file__).resolve().parents[1] / "examples" / "my_block_manager.py") + ":BlockManager")
    assert t.traits.prefix_caching in ("on", "both")
