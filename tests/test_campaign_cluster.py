"""A two-node Ray cluster on this machine (``ray start --head``, then a second
``ray start --address``), a small campaign on it, and the worker node killed while it
runs a job: Ray's task retries run that job again on the head node, every job
finishes exactly once, and the verdicts equal a one-process run. The jobs need no
environment of their own, so they run warm (forked from each Ray worker's kvspec
server): the kill takes the server and its job with the node.

Each node runs in its own session (``ray start --block`` in a new session), with its
own temp dir and one CPU, so killing the node is killing every process of its session
(raylet, GCS, the workers, each in a process group of its own, and the kvspec job
under them), and the ``finally`` kills both sessions: the test never calls ``ray
stop``, which would stop every Ray on the machine.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray", reason="kvspec campaign runs on Ray (pip install -e '.[test]')")
RAY = shutil.which("ray")

MATRIX = """
[campaign]
name = "two-nodes"
retries = 3

[[matrix]]
command = "check"
target = "impl"
patch = ["corpus:impl/no_evict.diff", ""]
level = "pool"
seed = [1, 2]
max_examples = 15
"""

# faster failure detection than Ray's defaults (a dead node is declared dead in ~3 s)
ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
       "RAY_health_check_initial_delay_ms": "1000", "RAY_USAGE_STATS_ENABLED": "0",
       # ray start --head turns token authentication on (the token in ~/.ray/auth_token); the
       # joining node and the driver must use it too
       "RAY_AUTH_MODE": "token"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(path: Path, pattern: str, proc: subprocess.Popen, seconds: float) -> re.Match:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        m = re.search(pattern, path.read_text(errors="replace")) if path.exists() else None
        if m:
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    pytest.fail(f"ray start did not report {pattern!r}: {path.read_text(errors='replace')[-2000:]}")


def _start(args: list[str], tmp: Path, env: dict) -> tuple[subprocess.Popen, Path]:
    out = tmp / "ray-start.out"
    proc = subprocess.Popen([RAY, "start", *args, "--num-cpus", "1", "--temp-dir", str(tmp), "--block",
                             "--disable-usage-stats"], env=env, start_new_session=True,
                            stdout=out.open("w"), stderr=subprocess.STDOUT)
    return proc, out


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (a node started by ``_start``)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _kill(proc: subprocess.Popen) -> None:
    """Kill the node: every process of its session (Ray's workers have process groups of their own)."""
    for pid in _session(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait(timeout=30)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _jobs_on(node: subprocess.Popen) -> list[int]:
    """The kvspec job processes running on ``node``: a ``python -m kvspec check`` subprocess,
    or a job forked from a Ray worker's warm server (kvspec.campaign.warm, forked from itself)."""
    out = []
    for pid in _session(node.pid):
        cmd = _cmdline(pid)
        if b"kvspec\x00check" in cmd or (b"kvspec.campaign.warm" in cmd and b"kvspec.campaign.warm" in
                                          _cmdline(_ppid(pid))):
            out.append(pid)
    return out


@pytest.mark.skipif(RAY is None, reason="the ray command line is not on PATH")
def test_two_nodes_a_node_killed_mid_run_every_job_once_same_verdicts(tmp_path):
    from kvspec.campaign.findings import findings_of
    from kvspec.campaign.matrix import load_campaign
    from kvspec.campaign.runner import run_serial

    env = {**os.environ, **ENV}
    # short temp dirs: Ray's unix socket paths must stay under ~100 characters
    head_tmp, worker_tmp = Path(tempfile.mkdtemp(prefix="kvh")), Path(tempfile.mkdtemp(prefix="kvw"))
    campaign_file = tmp_path / "two.toml"
    campaign_file.write_text(MATRIX)
    results = tmp_path / "results"
    head = worker = driver = None
    try:
        head, head_out = _start(["--head", "--port", str(_free_port()), "--include-dashboard=false"], head_tmp, env)
        address = _wait_for(head_out, r"ray start --address='([^']+)'", head, 120).group(1)
        worker, worker_out = _start(["--address", address], worker_tmp, env)
        _wait_for(worker_out, r"Ray runtime started", worker, 120)

        driver = subprocess.Popen([sys.executable, "-m", "kvspec", "campaign", str(campaign_file), "--address", address,
                                   "--results", str(results), "--json"], cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # kill the worker node while it runs a job (after at least one job has finished)
        end, killed_job = time.monotonic() + 180, []
        while time.monotonic() < end and driver.poll() is None:
            done = (results / "finished.log").read_text().splitlines() if (results / "finished.log").exists() else []
            killed_job = _jobs_on(worker)
            if done and killed_job:
                break
            time.sleep(0.05)
        assert killed_job and driver.poll() is None, "never saw a job running on the worker node"
        _kill(worker)
        out, err = driver.communicate(timeout=300)
        assert out.startswith("{"), f"exit {driver.returncode}: {out[-1000:]} {err[-3000:]}"
        got = json.loads(out)
    finally:
        for p in (driver, worker, head):
            if p is not None and p.poll() is None:
                _kill(p) if p is not driver else p.kill()
        shutil.rmtree(head_tmp, ignore_errors=True)
        shutil.rmtree(worker_tmp, ignore_errors=True)

    jobs = load_campaign(campaign_file).jobs
    assert got["counts"]["error"] == 0, err[-3000:]
    assert driver.returncode == 1 and got["jobs"] == len(jobs) == 4
    counts: dict[str, int] = {}
    for line in (results / "finished.log").read_text().splitlines():
        counts[line.split()[0]] = counts.get(line.split()[0], 0) + 1
    assert counts == {j.id: 1 for j in jobs}  # every job finished, exactly once

    def verdicts(records):
        return {r["id"]: (r["verdict"], sorted((f["invariant"], tuple(f["steps"])) for f in findings_of(r)))
                for r in records}
    records = [json.loads((results / "jobs" / f"{j.id}.json").read_text()) for j in jobs]
    assert {r["runner"] for r in records} <= {"warm", "warm-node"}  # the worker node's own servers, the head's node server
    assert verdicts(records) == verdicts(run_serial(jobs, timeout=300))  # fresh processes, one at a time
