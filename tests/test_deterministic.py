"""Issue 13: the same verdict on every machine, reproducible messages, and no hang.

* ``kvspec check --max-examples N`` stops on example counts only: two runs, one of them
  beside a CPU hog, print the same verdict, examples, steps and violations.
* impl's root hash is fixed under kvspec: two processes with different hash seeds
  print the same hash values.
* ``--op-timeout``: a user class whose ``free_blocks`` never returns is a ``NO_HANG``
  finding with a repro, and kvspec exits (code 1) instead of hanging.
"""
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvspec.targets import watchdog
from kvspec.cli import main

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "kvspec" / "corpus" / "impl"
SAME = ("verdict", "examples", "steps", "violations", "robustness")


def _check_json(args, capsys) -> dict:
    rc = main(["check", *args, "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == (1 if d["violations"] else 0)
    return d


def _hog() -> subprocess.Popen:
    """A busy process, so the second run sees a differently loaded machine."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@pytest.mark.parametrize("patch, n", [(None, 60), ("hash_no_parent.diff", 200)], ids=["pass", "violation"])
def test_two_runs_with_max_examples_print_the_same_result(patch, n, capsys, tmp_path):
    # The README's acceptance line uses --max-examples 300 on impl; 60 keeps this test fast.
    args = ["--target", "impl", "--max-examples", str(n), "--seed", "5", "--report-dir", str(tmp_path)]
    if patch:
        args += ["--patch", str(CORPUS / patch)]
    first = _check_json(args, capsys)
    hog = _hog()
    try:
        second = _check_json(args, capsys)
    finally:
        hog.kill()
        hog.wait()
    assert first["deterministic"] and (first["examples"] >= n or first["violations"]) and first["steps"] > 0
    assert first["verdict"] == ("violation" if patch else "pass")
    for key in SAME:
        assert first[key] == second[key], key
    # another seed does other work: the comparison above can fail
    other = _check_json(args[:5] + ["6"] + args[6:], capsys)
    assert (other["examples"], other["steps"]) != (first["examples"], first["steps"])


def test_deterministic_findings_carry_no_timing(capsys, tmp_path):
    d = _check_json(["--patch", str(CORPUS / "ref_not_decremented.diff"), "--level", "pool", "--max-examples", "100",
                     "--report-dir", str(tmp_path)], capsys)
    v = d["violations"][0]
    assert v["seconds_to_failure"] is None and v["examples_to_failure"] >= 1 and d["max_examples"] == 100


ROOT_HASH_SCRIPT = textwrap.dedent("""
    from kvspec.check.session import Session
    from kvspec.spec.config import Config
    from kvspec.spec.ops import Admit
    from kvspec.targets.impl_target import ImplTarget

    s = Session(ImplTarget(), Config(level="cache", num_blocks=6, block_size=2))
    s.apply(Admit("r1", (1, 2, 3, 4, 5)))
    print(sorted(s.obs.short_hash(b.hash) for b in s.obs.blocks if b.hash is not None))
""")


def test_the_same_seed_prints_the_same_hashes_in_two_processes():
    outs = []
    for env_seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", ROOT_HASH_SCRIPT], capture_output=True, text=True, timeout=120,
                           env={**__import__("os").environ, "PYTHONHASHSEED": env_seed})
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.strip())
    assert outs[0] == outs[1] and outs[0] != "[]"


def test_impl_itself_still_draws_a_root_per_process():
    # Outside kvspec the root stays unpredictable (the tenant-isolation reason in impl/hashing.py).
    code = "from kvspec.impl import hashing; print(hashing.NONE_HASH.hex())"
    import os
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    a, b = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env).stdout
            for _ in range(2))
    assert a and a != b


# -- the watchdog ---------------------------------------------------------------------------
HANGING_POOL = '''
import time

from kvspec.impl.block_pool import BlockPool as _Pool


class HangingPool(_Pool):
    """Frees one block at a time; a free of two or more never returns."""

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        if len(blocks) >= 2:
            while True:
                time.sleep(3600)
        return super().free_blocks(blocks)
'''


def test_a_hanging_method_is_a_no_hang_finding_and_kvspec_exits(tmp_path):
    f = tmp_path / "hanging_pool.py"
    f.write_text(HANGING_POOL)
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "kvspec.cli", "check", "--target", f"{f}:HangingPool", "--op-timeout", "1",
                        "--max-examples", "50", "--json", "--report-dir", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    d = json.loads(r.stdout)
    v = d["violations"][0]
    assert v["invariant"] == "NO_HANG" and "did not return within the op timeout of 1 s" in v["message"]
    assert v["steps"][-1]["op"] == "Free" and len(v["steps"][-1]["blocks"]) >= 2
    assert Path(v["repro"]).is_file()
    assert time.monotonic() - start < 240  # it came back (the limit is generous: a loaded CI machine)


def test_guarded_calls_return_raise_and_time_out():
    assert watchdog.guarded(5.0, lambda x: x + 1, 1) == 2
    with pytest.raises(KeyError):
        watchdog.guarded(5.0, lambda: {}["x"])
    for hang in (lambda: time.sleep(3600), lambda: threading.Event().wait(), lambda: sum(1 for _ in iter(int, 1))):
        with pytest.raises(watchdog.OpTimeout):
            watchdog.guarded(0.3, hang)
    assert watchdog.guarded(0.3, lambda: "after") == "after"  # a late signal does not hit the next call


def test_guarded_off_the_main_thread_uses_a_worker_thread():
    out: dict = {}

    def worker():
        try:
            watchdog.guarded(0.3, time.sleep, 3600)
        except watchdog.OpTimeout as e:
            out["timeout"] = e.seconds
        out["ok"] = watchdog.guarded(0.3, lambda: 7)

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert out == {"timeout": 0.3, "ok": 7}


def test_no_hang_is_in_the_catalogue():
    from kvspec.spec.invariants import CATALOGUE, PRIORITY
    assert "NO_HANG" in CATALOGUE and PRIORITY[0] == "NO_HANG"
    readme = (ROOT / "README.md").read_text()
    assert "| `NO_HANG` |" in readme and "--max-examples" in readme and "--op-timeout" in readme


def test_an_alarm_that_is_not_ours_reaches_the_handler_it_replaced():
    import signal
    hits = []
    before = signal.signal(signal.SIGALRM, lambda s, f: hits.append(s))  # pytest-timeout's, say
    try:
        with pytest.raises(watchdog.OpTimeout):
            watchdog.guarded(0.3, time.sleep, 3600)
        hits.clear()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        time.sleep(0.5)
        assert hits == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
