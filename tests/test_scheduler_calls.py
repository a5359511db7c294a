"""A package's own scheduler may call its block manager beyond the nano-vllm protocol
(issue 20: a fork hashing blocks in ``may_prefill`` after each chunk got a false I4).
kvspec reads the scheduler's source: a state-changing call it does not make refuses the
target in one line (exit 2) instead of reporting kvspec's missing call as a bug; a call
behind a feature switch, or one that only reads or keeps its own counters, is not
refused. Also: a Sequence that ties another size to its block size runs at its own.

Every package here is written into tmp_path (this project's code, built from
examples/my_block_manager.py) and checked from there, as a user would."""
import os
import subprocess
import sys
from pathlib import Path

from kvspec.targets.nano_api import tied_block_size

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "examples" / "my_block_manager.py").read_text()

HOOKS = '''

def _may_prefill(self, seq, end):
    """Hash the blocks a prefill chunk completed (the fork's scheduler calls it)."""
    for i in range(end // self.block_size):
        block = self.blocks[seq.block_table[i]]
        block.hash = -1


def _reset_stats(self):
    self.hits = 0


def _num_free(self):
    return len(self.free_block_ids)


BlockManager.may_prefill = _may_prefill
BlockManager.reset_stats = _reset_stats
BlockManager.num_free = _num_free
'''

SCHEDULER = '''
class Scheduler:
    def __init__(self, config):
        self.offload = config.offload
        self.block_manager = BlockManager(config.num_blocks, config.block_size)

    def schedule(self, seq):
        if self.block_manager.can_allocate(seq):
            self.block_manager.allocate(seq)
        self.block_manager.reset_stats()
        return self.block_manager.num_free()

    def postprocess(self, seq, token):
        {call}
        seq.append_token(token)
'''


def _fork(tmp: Path, call: str) -> None:
    eng = tmp / "fork" / "engine"
    eng.mkdir(parents=True)
    (tmp / "fork" / "__init__.py").write_text("import nonexistent_gpu_lib\n")
    (eng / "block_manager.py").write_text(EXAMPLE + HOOKS)
    (eng / "scheduler.py").write_text("from fork.engine.block_manager import BlockManager\n"
                                      + SCHEDULER.format(call=call))


def _check(cwd: Path, *more: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "kvspec", "check", "--target",
                           "fork/engine/block_manager.py:BlockManager", "--max-examples", "15", *more],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_an_undriven_state_changing_call_refuses_the_target_in_one_line(tmp_path):
    _fork(tmp_path, "self.block_manager.may_prefill(seq, len(seq))")
    r = _check(tmp_path, "--level", "cache")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("kvspec: error")]
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "fork/engine/scheduler.py:" in lines[0] and "may_prefill(seq, len(seq))" in lines[0]
    assert "--level engine" in lines[0] and "[tool.kvspec.protocol]" in lines[0]
    assert "reset_stats" not in lines[0] and "num_free" not in lines[0]  # counters and reads are no reason
    assert not list(tmp_path.rglob("test_*.py")), "a refusal writes no repro"


def test_a_call_behind_a_feature_switch_is_a_note_and_the_check_runs(tmp_path):
    _fork(tmp_path, "if self.offload:\n            self.block_manager.may_prefill(seq, len(seq))")
    r = _check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "may_prefill when self.offload" in r.stderr


def test_counters_and_reads_alone_do_not_refuse(tmp_path):
    _fork(tmp_path, "pass")
    r = _check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "scheduler" not in r.stderr


def test_tied_sizes_keep_the_sequences_own_block_size():
    class Paged:
        block_size = 256
        logical_page_size = 32  # pages divide blocks: set together by the package's scheduler

    class Plain:
        block_size = 256
        max_tokens = 64  # not a size tied to the block

    assert tied_block_size(Paged) == 256
    assert tied_block_size(Plain) is None
    assert tied_block_size(None) is None


def _paged_sequence() -> str:
    """test_user_loading's nano-shaped Sequence with a page size tied to its block size."""
    from test_user_loading import SEQUENCE
    out = SEQUENCE.replace("    block_size = 2\n", "    block_size = 16\n    page_size = 8  # pages divide blocks\n")
    old = "    def num_blocks(self):\n"
    assert old in out
    # a run at a smaller block size would break the tie
    return out.replace(old, old + "        assert self.block_size % self.page_size == 0\n")


def test_a_tied_sequence_runs_without_kvspecs_inconsistency_as_a_finding(tmp_path):
    eng = tmp_path / "paged" / "engine"
    eng.mkdir(parents=True)
    (eng / "sequence.py").write_text(_paged_sequence())
    (eng / "block_manager.py").write_text("from paged.engine.sequence import Sequence\n" + EXAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "kvspec", "check", "--target",
                        "paged/engine/block_manager.py:BlockManager", "--max-examples", "15", "--json"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_by_default_such_a_package_is_checked_through_its_own_scheduler(tmp_path):
    # the default levels go to the engine level, said in a note; this fixture's scheduler is
    # not nano-vllm-shaped, so the engine level refuses it in one line: never a finding
    _fork(tmp_path, "self.block_manager.may_prefill(seq, len(seq))")
    r = _check(tmp_path)
    assert "which only the package's own scheduler knows when to call: checking through it (--level engine)" in r.stderr
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert len([x for x in r.stderr.splitlines() if x.startswith("kvspec: error")]) == 1


def test_a_scheduler_shaped_otherwise_is_refused_at_the_engine_level_not_reported(tmp_path):
    # nanotiny (tests/data/nano_engine) with its schedule() renamed: kvspec's engine level
    # cannot make its calls, which is one line and exit 2, never a NO_CRASH finding
    import shutil
    shutil.copytree(ROOT / "tests" / "data" / "nano_engine" / "nanotiny", tmp_path / "nanotiny")
    sched = tmp_path / "nanotiny" / "engine" / "scheduler.py"
    sched.write_text(sched.read_text().replace("def schedule(self)", "def schedule_prefill(self)"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "kvspec", "check", "--target",
                        "nanotiny/engine/block_manager.py:BlockManager", "--level", "engine", "--max-examples", "10"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("kvspec: error")]
    assert len(errors) == 1 and "no schedule()" in errors[0] and "Traceback" not in r.stderr
    assert "VIOLATION" not in r.stdout
