"""The pytest plugin, end to end: fresh projects run by pytest in a subprocess.

The acceptance test writes a small nano-vllm-style BlockManager into a fresh project
and runs ``pytest --kvspec-target block_manager.py:BlockManager``: kvspec's machines
must be collected into that run and pass; a buggy variant (it can hit a whole
prompt, as nano-vllm's own manager does) must fail with the invariant id and the
path of a repro file that exists and replays the failure.
"""
from __future__ import annotations

import importlib.util
import re
import unittest
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"

# A nano-vllm-style manager (Sequence API, hash_to_block_id, free_block_ids deque,
# used_block_ids), written for this test. Hits never cover the whole prompt.
BLOCK_MANAGER = '''
from collections import deque


class Block:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1          # -1: not a full, cached block
        self.token_ids = []

    def fill(self, h, token_ids):
        self.hash, self.token_ids = h, list(token_ids)


class BlockManager:
    # its policies, declared (kvspec never probes them): can_allocate counts every block
    kvspec_traits = {"admit_all_blocks": True}

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id = {}
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()

    @staticmethod
    def chain(prefix, token_ids):
        return hash((prefix, tuple(token_ids))) & (2**62 - 1)

    def _claim(self, block_id):
        block = self.blocks[block_id]
        if self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]   # its old content is gone
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        block.ref_count, block.hash, block.token_ids = 1, -1, []
        return block

    def can_allocate(self, seq):
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq):
        h, hitting = -1, True
        hittable = HITTABLE
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            full = len(tokens) == self.block_size
            h = self.chain(h, tokens) if full else -1
            bid = self.hash_to_block_id.get(h, -1)
            hitting = hitting and i < hittable and bid != -1 and self.blocks[bid].token_ids == tokens
            if hitting:
                seq.num_cached_tokens += self.block_size
                if bid in self.used_block_ids:
                    self.blocks[bid].ref_count += 1
                    seq.block_table.append(bid)
                    continue
                block = self._claim(bid)
            else:
                block = self._claim(self.free_block_ids[0])
            if full:
                block.fill(h, tokens)
                self.hash_to_block_id[h] = block.block_id
            seq.block_table.append(block.block_id)

    def deallocate(self, seq):
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(bid)
                self.free_block_ids.append(bid)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq):
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq):
        table, n = seq.block_table, len(seq) % self.block_size
        if n == 1:
            table.append(self._claim(self.free_block_ids[0]).block_id)
        elif n == 0:
            prefix = self.blocks[table[-2]].hash if len(table) > 1 else -1
            tokens = seq.block(seq.num_blocks - 1)
            h = self.chain(prefix, tokens)
            self.blocks[table[-1]].fill(h, tokens)
            self.hash_to_block_id[h] = table[-1]
'''
CORRECT = BLOCK_MANAGER.replace("HITTABLE", "(len(seq) - 1) // self.block_size   # never the whole prompt")
FULL_HIT = BLOCK_MANAGER.replace("HITTABLE", "seq.num_blocks   # bug: may hit every token of the prompt")

FAST = ["-p", "no:cacheprovider", "--kvspec-profile", "ci"]


def outcomes(result) -> dict:
    """The run's test outcomes, without the warnings count (which depends on the other
    plugins installed, e.g. anyio's deprecation warning under a newer pytest)."""
    return {k: v for k, v in result.parseoutcomes().items() if k not in ("warnings", "warning")}


def _has_user_loader() -> bool:
    return importlib.util.find_spec("kvspec.targets.user_target") is not None


needs_user_loader = pytest.mark.skipif(
    not _has_user_loader(),
    reason="kvspec.targets.user_target (the FILE.py:NAME loader) is not in this checkout yet")


def _repro_path(text: str) -> Path:
    m = re.search(r"repro: (\S+\.py)", text)
    assert m, f"no repro path in the output:\n{text}"
    return Path(m.group(1))


def _nano_target(source: str, tmp_path: Path, name: str):
    """The manager above as a Target, through the nano-vllm adapter directly (no loader)."""
    from kvspec.targets.nano_sequence import Sequence
    from kvspec.targets.nanovllm_target import NanoTarget, declared_nano_traits, detect_nano_api

    ns: dict = {}
    exec(compile(source, str(tmp_path / f"{name}.py"), "exec"), ns)
    bm = ns["BlockManager"]
    return NanoTarget(bm, Sequence, name, declared_nano_traits(bm, Sequence, detect_nano_api(bm), name))


# -- the acceptance test: --kvspec-target FILE.py:NAME on a fresh project -------------------
@needs_user_loader
def test_target_on_command_line_runs_kvspec_machines(pytester):
    pytester.makepyfile(block_manager=CORRECT)
    result = pytester.runpytest_subprocess("--kvspec-target", "block_manager.py:BlockManager", "-v",
                                           "--kvspec-max-examples", "30", *FAST)
    result.stdout.fnmatch_lines(["*kvspec*block_manager.py:BlockManager*cache PASSED*"])
    seen = outcomes(result)
    assert seen.get("passed") == 1 and "failed" not in seen, seen  # nano-vllm style: cache level only
    assert result.ret == 0
    ran = re.search(r"kvspec\[block_manager.py:BlockManager\]::cache: (\d+) examples, (\d+) steps", result.stdout.str())
    assert ran and int(ran.group(1)) >= 25 and int(ran.group(2)) > 100, result.stdout.str()


@needs_user_loader
def test_buggy_manager_fails_with_invariant_and_repro(pytester):
    pytester.makepyfile(block_manager=FULL_HIT)
    result = pytester.runpytest_subprocess("--kvspec-target", "block_manager.py:BlockManager", *FAST)
    text = result.stdout.str()
    assert result.ret == 1, text
    assert outcomes(result).get("failed") == 1
    assert "VIOLATION MAX_HIT at the cache level" in text
    repro = _repro_path(text)
    if not repro.is_absolute():
        repro = pytester.path / repro
    assert repro.is_file()
    assert "TARGET = 'block_manager.py:BlockManager'" in repro.read_text()
    # the repro replays the failure on its own
    again = pytester.runpytest_subprocess(str(repro), "-p", "no:cacheprovider")
    assert again.ret == 1 and "MAX_HIT" in again.stdout.str()


# -- machines_for ---------------------------------------------------------------------------
def test_machines_for_impl_passes(pytester):
    pytester.makepyfile(test_mine="""
        from kvspec.stateful import machines_for
        TestImpl = machines_for("impl")
    """)
    result = pytester.runpytest("-v", *FAST, "--kvspec-max-examples", "20")
    result.stdout.fnmatch_lines(["*TestImpl::test_cache PASSED*", "*TestImpl::test_pool PASSED*"])
    assert outcomes(result) == {"passed": 2}


def test_machines_for_reports_invariant_and_repro(pytester):
    pytester.makepyfile(test_mine=f"""
        from kvspec.stateful import machines_for
        TestPatched = machines_for("impl", patch={str(CORPUS / 'no_evict.diff')!r}, level="pool")
    """)
    result = pytester.runpytest(*FAST)
    text = result.stdout.str()
    assert outcomes(result) == {"failed": 1}, text
    assert "VIOLATION I4 CACHED_EVICTABLE at the pool level" in text
    repro = _repro_path(text)
    assert repro.is_file() and repro.is_relative_to(pytester.path)
    assert "PATCH_TEXT" in repro.read_text()  # replays the patched target by itself


def test_machines_for_nano_style_class_without_loader(tmp_path):
    """The nano-vllm-style manager through machines_for, built as a Target directly."""
    from kvspec.pytest_plugin import KvspecFailure, RunOptions, run_machine
    from kvspec.stateful import machines_for

    good = machines_for(_nano_target(CORRECT, tmp_path, "good_bm"))
    assert [m for m in dir(good) if m.startswith("test_")] == ["test_cache"]  # no pool-level API
    opts = RunOptions(profile="ci", max_examples=200, repro_dir=str(tmp_path / "repros"))
    counters = run_machine(good.kvspec_target, "good_bm", "cache", opts)
    assert counters["steps"] > 0
    bad = _nano_target(FULL_HIT, tmp_path, "bad_bm")
    with pytest.raises(KvspecFailure) as e:
        run_machine(bad, "bad_bm", "cache", opts)
    assert e.value.invariant == "MAX_HIT" and Path(e.value.repro).is_file()
    assert "MAX_HIT" in str(e.value) and e.value.repro in str(e.value)


# -- --kvspec-target with impl, xdist, errors -------------------------------------------------
def test_xdist_runs_target_and_machines_for_with_failures_reported(pytester):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed")
    pytester.makepyfile(test_other=f"""
        from kvspec.stateful import machines_for

        def test_user_own():
            assert True

        TestPatched = machines_for("impl", patch={str(CORPUS / 'ref_not_decremented.diff')!r}, level="pool")
    """)
    result = pytester.runpytest_subprocess("-n", "2", "--kvspec-target", "impl", "--kvspec-max-examples", "20", *FAST)
    text = result.stdout.str()
    assert outcomes(result) == {"passed": 3, "failed": 1}, text  # kvspec[impl]::pool/cache, test_user_own
    assert re.search(r"2 workers", text), text
    assert "VIOLATION ACCOUNTING at the pool level" in text and _repro_path(text).is_file()
    # the machines' counters reach the controller's summary
    assert re.search(r"kvspec\[impl\]::pool: \d+ examples, \d+ steps", text), text


def test_unknown_target_is_one_line_collection_error(pytester):
    result = pytester.runpytest("--kvspec-target", "no_such_target", *FAST)
    text = result.stdout.str()
    assert result.ret != 0
    assert "kvspec: unknown target 'no_such_target'" in text
    assert "Traceback" not in text


def test_options_and_level_selection(pytester):
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest("--kvspec-target", "impl", "--kvspec-level", "pool", "--collect-only", "-q", *FAST)
    text = result.stdout.str()
    assert "kvspec[impl]::pool" in text and "kvspec[impl]::cache" not in text and "test_x.py::test_x" in text
    help_text = pytester.runpytest("--help").stdout.str()
    for opt in ("--kvspec-target", "--kvspec-level", "--kvspec-budget", "--kvspec-profile", "--kvspec-db",
                "--kvspec-max-examples", "--kvspec-op-timeout"):
        assert opt in help_text


def test_max_examples_runs_the_same_examples_twice(tmp_path):
    """--kvspec-max-examples: counts, never seconds; two runs do the same work, a third
    with another seed differs (so the comparison can fail)."""
    from kvspec.pytest_plugin import RunOptions, run_machine
    from kvspec.targets import load_target

    t = load_target("impl")
    runs = [run_machine(t, "impl", "pool", RunOptions(profile="dev", max_examples=30, seed=s,
                                                       repro_dir=str(tmp_path))) for s in (3, 3, 4)]
    a, b, c = [(r["examples"], r["steps"]) for r in runs]
    assert a == b and a[0] >= 30 and a != c


def test_max_examples_excludes_budget(pytester):
    result = pytester.runpytest("--kvspec-max-examples", "5", "--kvspec-budget", "1", *FAST)
    assert result.ret != 0 and "cannot be combined" in result.stderr.str()


# -- profiles and the example database ---------------------------------------------------------
def test_profiles(monkeypatch):
    from hypothesis import settings

    from kvspec.pytest_plugin import choose_profile, profile_settings, register_profiles

    register_profiles()
    assert settings.get_profile("kvspec-ci").derandomize is True
    assert settings.get_profile("kvspec-ci").database is None
    assert settings.get_profile("kvspec-deep").max_examples > settings.get_profile("kvspec-dev").max_examples
    assert settings.get_profile("ci").stateful_step_count == settings.default.stateful_step_count  # Hypothesis's own untouched
    for var in ("KVSPEC_PROFILE", "HYPOTHESIS_PROFILE", "CI"):
        monkeypatch.delenv(var, raising=False)
    assert choose_profile() == "dev"
    monkeypatch.setenv("CI", "true")
    assert choose_profile() == "ci"
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "kvspec-deep")
    assert choose_profile() == "deep"
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "my-own-profile")
    assert choose_profile() == "ci"
    monkeypatch.setenv("KVSPEC_PROFILE", "dev")
    assert choose_profile() == "dev"
    assert choose_profile("deep") == "deep"
    with pytest.raises(ValueError):
        choose_profile("fast")
    assert profile_settings("dev", database="/tmp/x").database is not None


def test_found_failure_replays_from_the_example_database(tmp_path, monkeypatch):
    """A failure found by a random profile is saved under the machine's key, and the next
    run replays it even with generation switched off."""
    from hypothesis import Phase
    from hypothesis.database import DirectoryBasedExampleDatabase

    import kvspec.pytest_plugin as plugin
    from kvspec.targets import load_target

    target = load_target("impl", patch=str(CORPUS / "ref_not_decremented.diff"))  # found by any alloc + free
    db = tmp_path / "db"
    opts = plugin.RunOptions(profile="dev", database=str(db), repro_dir=str(tmp_path / "repros"))
    with pytest.raises(plugin.KvspecFailure) as first:
        plugin.run_machine(target, "impl", "pool", opts)
    assert list(DirectoryBasedExampleDatabase(str(db)).fetch(plugin._db_key("impl", target, "pool")))
    monkeypatch.setitem(plugin.PROFILES, "dev", {**plugin.PROFILES["dev"], "phases": (Phase.reuse,)})
    with pytest.raises(plugin.KvspecFailure) as again:
        plugin.run_machine(target, "impl", "pool", opts)
    assert again.value.invariant == first.value.invariant
    # without the database the same settings run nothing at all: the failure came from it
    with pytest.raises(unittest.SkipTest):  # Hypothesis: "told to run no examples"
        plugin.run_machine(target, "impl", "pool", plugin.RunOptions(profile="dev", database=str(tmp_path / "empty")))


