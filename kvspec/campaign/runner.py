"""Run one campaign job: ``kvspec <command> ... --json`` in a process of its own.

A process of its own, not a call in the Ray worker: a job patches modules, installs
signal handlers and may shadow the installed vLLM through ``PYTHONPATH``; none of that
may leak into the next job the same worker runs. Which process:

- a job with an environment of its own (``env``, ``pythonpath``: a release tree) is a
  fresh ``python -m kvspec`` subprocess, with that environment;
- every other job (``warm``, the default) is a fork of this worker's warm kvspec
  server (``kvspec.campaign.warm``), which has kvspec and the target's package
  imported already: the same command line and the same verdict without paying the
  interpreter's and the imports' start-up per job (seconds a job; the corpus run is
  many short jobs).

Either way it runs in a scratch directory (a checkout's ``kvspec/`` folder in the
working directory would shadow the installed package), within ``timeout`` seconds,
and its repro files are read back into the result, so the driver can keep them
whichever node ran the job.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from kvspec.campaign.matrix import CORPUS_PREFIX, Job

STDERR_TAIL = 2000
REPRO_BYTES = 200_000  # a job's repro files kept in its result, at most


def _corpus_path(value: str) -> str:
    root = Path(__file__).resolve().parent.parent / "corpus"
    return str(root / value[len(CORPUS_PREFIX):])


def command_line(job: Job, report_dir: Optional[str]) -> list[str]:
    """The full command line, ``corpus:`` paths resolved on this node."""
    argv = [_corpus_path(a) if a.startswith(CORPUS_PREFIX) else a for a in job.argv()]
    argv.append("--json")
    if job.command == "patches" and "--jobs" not in argv:
        argv += ["--jobs", "1"]  # Ray places the jobs; one job is one core
    if job.command == "patches":
        # no per-job report files: the campaign merges the trials from the JSON, and drawing
        # patches_ttf.png in every job cost about 3 s a job (matplotlib) on this machine
        report_dir = ""
    if report_dir is not None:
        argv += ["--report-dir", report_dir]  # last: run_job cuts it from the command it reports
    return [sys.executable, "-m", "kvspec", *argv]


def _env(job: Job) -> dict[str, str]:
    env = dict(os.environ)
    env.update(job.env)
    if job.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*job.pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("KVSPEC_DEBUG", None)
    return env


def _json_line(out: str) -> Optional[dict]:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                got = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(got, dict):
                return got
    return None


def _repros(d: Path) -> dict[str, str]:
    out, size = {}, 0
    for f in sorted(d.rglob("test_*.py")):
        text = f.read_text(errors="replace")
        size += len(text)
        if size > REPRO_BYTES:
            break
        out[f.name] = text
    return out


def verdict_of(command: str, exit_code: int, result: Optional[dict]) -> str:
    """pass, violation (check, mc), fail (patches: a bug the corpus run missed) or error."""
    if result is None or exit_code not in (0, 1):
        return "error"
    v = result.get("verdict")
    return v if v in (("pass", "fail") if command == "patches" else ("pass", "violation")) else "error"


def warm_eligible(job: Job) -> bool:
    """A job that needs no environment of its own can run in the warm server."""
    return not job.env and not job.pythonpath


def _subprocess(cmd: list[str], job: Job, scratch: str, timeout: float) -> tuple[Optional[int], str, str]:
    # a process group of its own: past the limit its trial workers (kvspec patches forks them) go too
    with subprocess.Popen(cmd, env=_env(job), cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, process_group=0) as p:
        try:
            out, err = p.communicate(timeout=timeout)
            return p.returncode, out, err
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
            return 124, "", (err or "") + f"\nkvspec campaign: job killed after its {timeout:g} s job_timeout"


def run_job(job_d: dict, timeout: float = 3600.0, warm: bool = True,
            node_server: Optional[str] = None) -> dict[str, Any]:
    """Run the job ``job_d`` (``Job.to_dict()``) here and return its result record;
    ``warm``: forked from a warm server when the job allows it (``warm_eligible``): the
    node's (``node_server``, its socket) where there is one, else this process's own."""
    job = Job.from_dict(job_d)
    t0 = time.time()
    how = "warm" if warm and warm_eligible(job) else "process"
    with tempfile.TemporaryDirectory(prefix="kvspec-campaign-job-") as scratch:
        reports = Path(scratch) / "reports"
        cmd = command_line(job, str(reports))
        if how == "warm":
            from kvspec.campaign.warm import client, run_on_node
            target = job.options.get("target")
            got = run_on_node(node_server, cmd[3:], scratch, timeout, target) if node_server else None
            if got is None:
                got = client(_env(job)).run(cmd[3:], scratch, timeout, target)
            else:
                how = "warm-node"
            code, out, err = got
        else:
            code, out, err = _subprocess(cmd, job, scratch, timeout)
        result = _json_line(out)
        repros = _repros(reports) if reports.is_dir() else {}
    verdict = verdict_of(job.command, code if code is not None else -1, result)
    error = None
    if verdict == "error":
        error = (result or {}).get("error") or _last_line(err) or f"exit code {code}"
    shown = cmd[3:-2] if "--report-dir" in cmd else cmd[3:]  # the scratch report dir is gone by now
    return {"id": job.id, "label": job.label, "command": job.command, "argv": ["kvspec", *shown],
            "env": job.env, "pythonpath": list(job.pythonpath), "exit_code": code, "verdict": verdict,
            "error": error, "seconds": round(time.time() - t0, 3), "node": socket.gethostname(),
            "pid": os.getpid(), "runner": how, "result": result, "repros": repros, "stderr_tail": err[-STDERR_TAIL:]}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def run_serial(jobs: list[Job], timeout: float = 3600.0, warm: bool = False) -> list[dict]:
    """Every job one after the other in this process's children: the one-process baseline
    (fresh ``python -m kvspec`` processes unless ``warm``)."""
    return [run_job(j.to_dict(), timeout, warm) for j in jobs]
