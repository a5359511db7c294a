"""Issue 35 points 2 and 6: every verdict says what it covered (operations drawn and never
drawn, target methods never called, a changed method the level never calls), and the
smaller things: a pasteable replay command, the user's frames of a NO_CRASH, repros kept
out of pytest's collection, the stop rule in the Markdown report, why a repro is or is
not minimal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPL = ROOT / "kvspec" / "corpus" / "impl"


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    from kvspec.cli import main
    code = main(args)
    return code, capsys.readouterr().out


def test_every_output_lists_what_the_run_drew_and_called(tmp_path, capsys):
    out_dir = tmp_path / "out"
    code, out = run_cli(["check", "--target", "impl", "--level", "pool", "--max-examples", "20", "--seed", "0",
                         "--json", "--report-dir", str(out_dir)], capsys)
    assert code == 0
    cov = json.loads(out)["coverage"]["levels"]["pool"]
    assert cov["ops_drawn"] and all(n > 0 for n in cov["ops_drawn"].values())
    from kvspec.spec import ops
    pool_ops = {c.__name__ for c in vars(ops).values() if isinstance(c, type) and getattr(c, "level", "") == "pool"}
    assert set(cov["ops_drawn"]) | set(cov["ops_never_drawn"]) == pool_ops  # every op, drawn or not
    assert "CachePartial" in cov["ops_never_drawn"]  # a misuse op: never drawn without --misuse
    assert "BlockPool.get_new_blocks" in cov["methods_called"]
    assert cov["methods_never_called"] == sorted(cov["methods_never_called"])
    md = (out_dir / "kvspec-check.md").read_text()
    assert "## What this run covered" in md and "CachePartial" in md
    props = {p.get("name"): p.get("value") for p in ET.parse(out_dir / "kvspec-check.junit.xml").iter("property")}
    assert "Alloc" in props["pool_ops_drawn"] and "CachePartial" in props["pool_ops_never_drawn"]
    assert "pool_methods_never_called" in props
    code, text = run_cli(["check", "--target", "impl", "--level", "pool", "--max-examples", "20", "--seed", "0",
                          "--report-dir", str(tmp_path / "out2")], capsys)
    assert "pool level drew " in text and "never drew" in text and "CachePartial" in text


def test_a_pass_on_a_method_the_level_never_calls_says_so(tmp_path, capsys):
    """The issue's case on impl: a patch to BlockPool.reset_prefix_cache passes at a level
    that never calls it; the verdict says so in one line and names the level that does."""
    code, out = run_cli(["check", "--target", "impl", "--patch", str(IMPL / "reset_keeps_index.diff"),
                         "--level", "cache", "--max-examples", "20", "--seed", "0", "--json",
                         "--report-dir", str(tmp_path / "out")], capsys)
    got = json.loads(out)
    assert got["verdict"] == "pass" and code == 0
    notes = got["coverage"]["notes"]
    assert notes == ["the cache level never called reset_prefix_cache; the pool level does (--level pool)"]
    md = (tmp_path / "out" / "kvspec-check.md").read_text()
    assert "never called reset_prefix_cache; the pool level does" in md


def test_markdown_states_the_stop_rule_used(tmp_path, capsys):
    run_cli(["check", "--target", "impl", "--level", "pool", "--max-examples", "7", "--report-dir", str(tmp_path)], capsys)
    md = (tmp_path / "kvspec-check.md").read_text()
    assert "--max-examples 7" in md
    assert "budget" not in md.split("## ")[0].lower().replace("--budget", "")  # no budget claimed for a count run


def test_replay_command_can_be_pasted_and_replays(tmp_path, capsys):
    work = tmp_path / "proj"
    work.mkdir()
    here = os.getcwd()
    os.chdir(work)
    try:
        code, text = run_cli(["check", "--target", "impl", "--patch", str(IMPL / "no_evict.diff"), "--level", "pool",
                              "--max-examples", "60", "--seed", "0"], capsys)
    finally:
        os.chdir(here)
    assert code == 1
    line = next(x for x in text.splitlines() if x.strip().startswith("replay: "))
    cmd = line.strip()[len("replay: "):].split("   (")[0]
    assert cmd.startswith("python -m pytest reports/repros/")
    # pasted as printed, in the directory kvspec check ran in: the repro fails as the finding did
    r = subprocess.run(cmd.replace("python", sys.executable, 1), shell=True, cwd=work, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 1 and "I4" in r.stdout + r.stderr, r.stdout[-2000:]
    # a plain pytest of the project does not collect the repro; naming it or its folder does
    plain = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                           cwd=work, capture_output=True, text=True, timeout=600)
    assert "reports/repros/test_" not in plain.stdout, plain.stdout
    named = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            "reports/repros"], cwd=work, capture_output=True, text=True, timeout=600)
    assert "reports/repros/test_" in named.stdout, named.stdout


CRASHER = '''
def _lookup(table, key):
    return table[key]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [None] * num_blocks
        self.hash_to_block_id = {}
        self.free_block_ids = list(range(num_blocks))
        self.used_block_ids = set()

    def can_allocate(self, seq) -> bool:
        return True

    def allocate(self, seq) -> None:
        _lookup({}, "missing")

    def can_append(self, seq) -> bool:
        return True

    def may_append(self, seq) -> None:
        pass

    def deallocate(self, seq) -> None:
        pass

    def kvspec_observe(self):
        return {"blocks": [(0, None, [])] * len(self.blocks), "free": list(self.free_block_ids), "index": {}}
'''


def test_no_crash_shows_the_users_frames(tmp_path, capsys):
    (tmp_path / "crasher.py").write_text(CRASHER)
    code, out = run_cli(["check", "--target", f"{tmp_path / 'crasher.py'}:BlockManager", "--max-examples", "20",
                         "--json", "--report-dir", str(tmp_path / "out")], capsys)
    v = json.loads(out)["violations"][0]
    assert v["invariant"] == "NO_CRASH"
    assert "crasher.py:3 in _lookup, called from crasher.py:18 in allocate" in v["message"], v["message"]
    assert "kvspec" not in v["message"].split("(at ")[1]  # kvspec's own frames left out


def test_every_repro_says_why_it_is_or_is_not_minimal(tmp_path):
    from kvspec.check.repro import write_repro
    from kvspec.spec.config import Config
    from kvspec.spec.ops import Alloc
    from kvspec.targets import load_target
    t = load_target("impl")
    for level, minimal, words in (("engine", None, "minimal: not proven (at the engine level"),
                                  ("pool", True, "minimal: true ("), ("pool", None, "minimal: not proven (")):
        p = write_repro(tmp_path / level, "impl", t, Config(level=level, num_blocks=4, block_size=2), [Alloc(1)],
                        "I1", "m", minimal=minimal)
        assert words in p.read_text(), p.read_text()[:600]
