"""User targets, ``FILE.py:NAME`` and ``module:NAME``: API detection (and ``--api``),
classes and factories, the Sequence kvspec brings, ``--patch`` on a user's file or
package, and one-line errors (exit 2) for everything that is not an allocator.

The examples' allocators and the counted-API manager below are this project's own
code; the vLLM-signature case needs the real vllm and is skipped without it."""
import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from kvspec.check.search import run_check
from kvspec.cli import main
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Finish, Step
from kvspec.check.session import Session
from kvspec.targets import nano_sequence
from kvspec.targets.base import TargetError
from kvspec.targets.nanovllm_target import BOOLEAN, COUNTED, NanoTarget
from kvspec.targets.registry import load_target
from kvspec.targets.user_target import UserTarget

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "my_block_manager.py"
BUGGY = ROOT / "examples" / "my_block_manager_buggy.py"

# A manager of the later nano-vllm API generation (can_allocate returns the number of
# cached blocks or -1, allocate(seq, n), hash_blocks after each forward), vLLM's policy.
COUNTED_SRC = '''
from collections import deque
import hashlib


class Block:
    def __init__(self, block_id):
        self.block_id, self.ref_count, self.hash, self.token_ids = block_id, 0, -1, []


class CountedManager:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id = {}
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()

    @staticmethod
    def compute_hash(token_ids, prefix=-1):
        return int.from_bytes(hashlib.sha256(repr((prefix, list(token_ids))).encode()).digest()[:8], "little")

    def _lookup(self, seq, n):
        h, out = -1, []
        for i in range(n):
            h = self.compute_hash(seq.block(i), PREFIX(h))
            b = self.hash_to_block_id.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def can_allocate(self, seq):
        hits = self._lookup(seq, (len(seq) - 1) // self.block_size)
        need = seq.num_blocks - len(hits) + sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return len(hits) if len(self.free_block_ids) >= need else -1

    def _take(self):
        b = self.free_block_ids.popleft()
        blk = self.blocks[b]
        if blk.hash != -1 and self.hash_to_block_id.get(blk.hash) == b:
            del self.hash_to_block_id[blk.hash]
        blk.ref_count, blk.hash, blk.token_ids = 1, -1, []
        self.used_block_ids.add(b)
        return b

    def allocate(self, seq, num_cached_blocks):
        for b in self._lookup(seq, num_cached_blocks):
            if self.blocks[b].ref_count == 0:
                self.free_block_ids.remove(b)
                self.used_block_ids.add(b)
            self.blocks[b].ref_count += 1
            seq.block_table.append(b)
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take())
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def deallocate(self, seq):
        for b in reversed(seq.block_table):
            self.blocks[b].ref_count -= 1
            if self.blocks[b].ref_count == 0:
                self.used_block_ids.remove(b)
                self.free_block_ids.append(b)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq):
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq):
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._take())

    def hash_blocks(self, seq):
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else -1
        for i in range(start, end):
            blk = self.blocks[seq.block_table[i]]
            h = self.compute_hash(seq.block(i), PREFIX(h))
            blk.hash, blk.token_ids = h, list(seq.block(i))
            self.hash_to_block_id[h] = blk.block_id
'''


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _one_line_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    # the error is one line; a "declares no policies" note may stand before it (once per process)
    err = "\n".join(line for line in err.strip().splitlines() if not line.startswith("kvspec: note:"))
    assert len(err.splitlines()) == 1, err
    return err


# -- the examples: the README's five-minute check ------------------------------------------
def test_the_example_passes(tmp_path):
    t = load_target(f"{EXAMPLE}:BlockManager")
    assert isinstance(t, NanoTarget) and t.api == BOOLEAN and t.seq_cls is nano_sequence.Sequence
    assert not t.traits.admit_all_blocks and not t.traits.free_evicts  # undeclared: vLLM's policies, never probed
    report = run_check(t, "example", level="all", seed=0, max_examples=60, report_dir=str(tmp_path))
    assert report.verdict == "pass" and report.levels == ["cache"] and report.steps > 300


def test_the_buggy_example_is_reported_from_the_cli_and_its_repro_replays(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = "examples/my_block_manager_buggy.py:BlockManager"
    assert main(["check", "--target", spec, "--json", "--max-examples", "1000", "--report-dir", str(tmp_path)]) == 1
    d = json.loads(capsys.readouterr().out)
    v = d["violations"][0]
    assert d["verdict"] == "violation" and v["invariant"] == "INDEX_CONSISTENT" and v["num_steps"] <= 3
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", v["repro"]],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "INDEX_CONSISTENT" in r.stdout


def test_explicit_api(tmp_path, capsys):
    assert isinstance(load_target(f"{EXAMPLE}:BlockManager", api="nanovllm"), NanoTarget)
    err = _one_line_error(capsys, "check", "--target", f"{EXAMPLE}:BlockManager", "--api", "kvcachemanager")
    assert "lacks the KVCacheManager methods get_computed_blocks, allocate_slots, free" in err


# -- classes, factories, packages, Sequences ----------------------------------------------
def _package(tmp_path, monkeypatch, extra: str = "") -> tuple[str, Path]:
    """A fresh importable package holding a copy of the example (plus ``extra``)."""
    name = f"kvs_user_{uuid.uuid4().hex[:8]}"
    _write(tmp_path / name / "__init__.py", "")
    _write(tmp_path / name / "alloc.py", EXAMPLE.read_text() + textwrap.dedent(extra))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, tmp_path


def test_module_target_uses_its_own_sequence(tmp_path, monkeypatch):
    name, _ = _package(tmp_path, monkeypatch, """
        from kvspec.targets.nano_sequence import Sequence as _Base


        class Sequence(_Base):
            built = 0

            def __init__(self, token_ids):
                super().__init__(token_ids)
                type(self).built += 1
        """)
    t = load_target(f"{name}.alloc:BlockManager")
    assert t.seq_cls.__module__ == f"{name}.alloc" and t.name == f"{name}.alloc:BlockManager"
    s = Session(t, Config(level="cache", num_blocks=4, block_size=2))
    for op in (Admit("r1", (1, 2, 3)), Step("r1", 4), Admit("r2", (1, 2, 3, 4, 5)), Finish("r1")):
        assert s.apply(op) == [], op
    assert s.obs.requests["r2"].table[:2] == (0, 1) and t.seq_cls.built >= 2


def test_module_target_with_a_patch(tmp_path, monkeypatch):
    name, root = _package(tmp_path, monkeypatch)
    # the patch changes the free order only: checked once the package states one
    _write(tmp_path / "pyproject.toml", '[tool.kvspec]\nfree_order = "lru_tail_first"\n')
    lines = (tmp_path / name / "alloc.py").read_text().splitlines(keepends=True)
    i = next(k for k, line in enumerate(lines) if "for block_id in reversed(seq.block_table):" in line)
    diff = (f"--- a/{name}/alloc.py\n+++ b/{name}/alloc.py\n@@ -{i + 1},1 +{i + 1},1 @@\n"
            f"-{lines[i]}+{lines[i].replace('reversed(seq.block_table)', 'seq.block_table')}")
    patch = _write(tmp_path / "forward.diff", diff)
    t = load_target(f"{name}.alloc:BlockManager", patch=str(patch))
    assert t.name.endswith("+" + str(patch))
    s = Session(t, Config(level="cache", num_blocks=4, block_size=2))
    assert s.apply(Admit("r1", (1, 2, 3))) == []
    assert [v.invariant for v in s.apply(Finish("r1"))][:1] == ["EVICTION_ORDER"]
    assert "reversed(seq.block_table)" in (tmp_path / name / "alloc.py").read_text()  # the user's file is untouched
    bad = _write(tmp_path / "bad.diff", diff.replace(f"a/{name}/", "a/elsewhere/").replace(f"b/{name}/", "b/elsewhere/"))
    with pytest.raises(TargetError, match=f"not under {name}/"):
        load_target(f"{name}.alloc:BlockManager", patch=str(bad))


def test_a_factory_is_called_with_the_constructor_convention(tmp_path):
    f = _write(tmp_path / "factory.py", f"""
        import sys
        sys.path.insert(0, {str(EXAMPLE.parent)!r})
        from my_block_manager import BlockManager
        calls = []


        def make(num_blocks, block_size):
            calls.append((num_blocks, block_size))
            return BlockManager(num_blocks, block_size)
        """)
    t = load_target(f"{f}:make")
    assert isinstance(t, NanoTarget) and t.make is not None and t.manager_cls.__name__ == "BlockManager"
    s = Session(t, Config(level="cache", num_blocks=5, block_size=3))
    assert s.apply(Admit("r1", (1, 2, 3, 4))) == [] and sys.modules[t.make.__module__].calls[-1] == (5, 3)


@pytest.mark.parametrize("prefix, verdict", [("lambda h: h", "pass"), ("lambda h: -1", "violation")],
                         ids=["correct", "hash_without_parent"])
def test_the_counted_api_generation(tmp_path, prefix, verdict):
    f = _write(tmp_path / f"counted_{verdict}.py", COUNTED_SRC.replace("\nclass Block", f"\nPREFIX = {prefix}\n\n\nclass Block"))
    t = load_target(f"{f}:CountedManager")
    assert t.api == COUNTED and not t.traits.admit_all_blocks and not t.traits.free_evicts
    report = run_check(t, "counted", level="cache", seed=0, max_examples=200, report_dir=str(tmp_path))
    assert report.verdict == verdict
    if verdict == "violation":
        assert report.violations[0].invariant == "HASH_CHAIN"


def test_vllm_shaped_classes_from_kvspec_impl(tmp_path):
    pool = load_target("kvspec.impl.block_pool:BlockPool")
    mgr = load_target("kvspec.impl.kv_cache_manager:KVCacheManager")
    assert isinstance(pool, UserTarget) and (pool.api, pool.style, pool.traits.levels) == ("blockpool", "kvspec impl", ("pool",))
    assert (mgr.api, mgr.traits.levels) == ("kvcachemanager", ("cache",))
    # impl declares its policies in code (BlockPool.kvspec_traits): KVCacheError for any misuse
    # without a more specific class
    assert pool.traits.null_block and dict(pool.traits.misuse_error_map)["*"].__name__ == "KVCacheError"
    assert dict(pool.traits.misuse_error_map)["double_free"].__name__ == "DoubleFreeError"
    for t in (pool, mgr):
        report = run_check(t, t.name, level="all", misuse=True, seed=0, max_examples=30, report_dir=str(tmp_path))
        assert report.verdict == "pass" and not report.robustness and report.steps > 100


@pytest.mark.upstream
def test_vllm_signature_classes_are_driven_as_vllm_is(tmp_path):
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except ImportError as e:  # not installed, or its import chain fails here: say which
        pytest.skip(f"vllm's allocator is not importable ({type(e).__name__}: {str(e)[:160]}); "
                    f"pip install --no-deps -r requirements/upstream.txt")
    pool = load_target("vllm.v1.core.block_pool:BlockPool")
    mgr = load_target("vllm.v1.core.kv_cache_manager:KVCacheManager", api="kvcachemanager")
    assert (pool.style, pool.traits.unhashed_free_first) == ("vLLM", True) and mgr.traits.levels == ("cache",)
    for t in (pool, mgr):
        report = run_check(t, t.name, level="all", seed=0, max_examples=30, report_dir=str(tmp_path))
        assert report.verdict == "pass" and report.steps > 100


# -- not an allocator: one line, exit 2 ----------------------------------------------------
BAD = {
    "no_file": ("nosuch.py:X", "no such file nosuch.py"),
    "no_name": ("{d}/lib.py:Nope", "has no Nope"),
    "not_callable": ("{d}/lib.py:X", "int object is neither a class nor a factory"),
    "no_api": ("{d}/lib.py:Thing", "Thing has none of the APIs kvspec drives"),
    "no_internals": ("{d}/lib.py:Opaque", "has the nano-vllm BlockManager methods but not the internals"),
    "factory_raises": ("{d}/lib.py:broken_factory", "calling the factory broken_factory(4, 2) raised RuntimeError: boom"),
    "import_raises": ("{d}/raises.py:X", "importing"),
    "syntax": ("{d}/syntax.py:X", "syntax error in"),
    "bad_name": ("{d}/lib.py:1x", "is not a Python name"),
    "no_module": ("kvs_no_such_module.sub:X", "No module named 'kvs_no_such_module'"),
    "bad_ctor": ("{d}/lib.py:NeedsConfig", "cannot build NeedsConfig(num_blocks, block_size)"),
}


@pytest.fixture
def lib(tmp_path):
    _write(tmp_path / "lib.py", """
        X = 3


        class Thing:
            def allocate(self, seq):
                pass


        class Opaque:
            def __init__(self, num_blocks, block_size):
                pass

            def can_allocate(self, seq): return True
            def allocate(self, seq): pass
            def deallocate(self, seq): pass
            def can_append(self, seq): return True
            def may_append(self, seq): pass


        class NeedsConfig(Opaque):
            def __init__(self, config):  # kvspec builds the config (issue 31); this constructor still refuses it
                raise ValueError("config.model must be a model directory")


        def broken_factory(num_blocks, block_size):
            raise RuntimeError("boom")
        """)
    _write(tmp_path / "raises.py", "raise ValueError('not today')\n")
    _write(tmp_path / "syntax.py", "def f(:\n")
    return tmp_path


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_targets_are_one_line_and_exit_2(case, lib, capsys):
    spec, expected = BAD[case]
    err = _one_line_error(capsys, "check", "--target", spec.format(d=lib), "--budget", "1")
    assert expected in err


def test_bad_api_and_level_combinations(capsys):
    assert "has a fixed API" in _one_line_error(capsys, "check", "--target", "impl", "--api", "nanovllm")
    assert "does not support the pool level" in _one_line_error(capsys, "check", "--target", f"{EXAMPLE}:BlockManager",
                                                                "--level", "pool")
    assert "lacks the BlockPool methods" in _one_line_error(capsys, "mc", "--target", f"{EXAMPLE}:BlockManager",
                                                            "--api", "blockpool")


def test_a_patch_for_a_file_target_may_change_only_that_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    src = EXAMPLE.read_text().splitlines(keepends=True)
    i = next(k for k, line in enumerate(src) if "del self.hash_to_block_id[block.hash]" in line)
    diff = (f"--- a/examples/my_block_manager.py\n+++ b/examples/my_block_manager.py\n@@ -{i},2 +{i},0 @@\n"
            f"-{src[i - 1]}-{src[i]}")
    patch = _write(tmp_path / "stale.diff", diff)
    assert main(["check", "--target", "examples/my_block_manager.py:BlockManager", "--patch", str(patch), "--json",
                 "--max-examples", "1000", "--report-dir", str(tmp_path)]) == 1
    assert json.loads(capsys.readouterr().out)["violations"][0]["invariant"] == "INDEX_CONSISTENT"
    other = _write(tmp_path / "other.diff", diff.replace("examples/my_block_manager.py", "examples/other.py"))
    err = _one_line_error(capsys, "check", "--target", "examples/my_block_manager.py:BlockManager", "--patch", str(other))
    assert "may change only my_block_manager.py" in err
