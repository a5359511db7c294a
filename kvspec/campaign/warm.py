"""Warm jobs: a long-lived ``kvspec`` process that forks one child per job.

A fresh ``python -m kvspec`` per job pays the interpreter, kvspec's imports and the
target's package (torch for nano-vllm, about 20 s for vLLM) every time; on a small
machine that made a corpus campaign 1.25-1.34x slower than ``kvspec patches --jobs 2``.
A job that needs no environment of its own (no ``env``, no ``pythonpath``: everything
but a release tree) runs here instead:

- the *server* loads kvspec's checkers and each target's package the first time a job
  names it (``load_target``, as ``kvspec patches`` does before it forks its trials);
- each job is a ``fork`` of that warm server: the child runs ``python -m kvspec`` on
  the job's command line (``runpy``, as the interpreter's ``-m`` does), in the job's scratch directory, with stdout and stderr going
  to files. A job still gets a process of its own, so what it patches, the signal
  handlers it installs and the modules it loads never reach the next job: its verdict
  is the one the subprocess path gives.
- the time limit: the child leads a process group of its own (``kvspec patches``
  forks its trials under it); past its limit the server kills the whole group.

One server (``serve_node``, ``python -m kvspec.campaign.warm --listen SOCKET``) takes jobs
over a Unix socket, several at a time, one connection per job: a request line
``{"argv", "cwd", "timeout", "target"}``, a reply line ``{"exit_code", "timed_out"}``
when the job is done (``run_on_node``). A client that goes away (its Ray worker killed)
closes its connection, and the server kills that job. Who starts one:

- the driver, before Ray, on its own node (``NodeServer``): every job of that node, its
  early ones and all its Ray workers', is forked from it. One import of the target per
  node, as ``kvspec patches --jobs N`` pays one per run, and it overlaps Ray's start.
- on the other nodes of a cluster, each Ray worker, on its first job (``WarmClient``),
  and keeps it; one that died or stopped answering is replaced for the next job.

A server exits when its owner closes its stdin; on Linux it and its jobs also get
SIGKILL from the kernel when their parent dies (PR_SET_PDEATHSIG). Only a server forks,
never a Ray worker or the driver (processes with threads), and a server starts no
threads; its fd 1 goes to stderr, so a target that prints while it loads writes nowhere
a reply could be.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

POLL_S = 0.05
GRACE_S = 300.0  # past a job's limit, how long the client waits for an answer (the first import of vLLM is ~20 s)


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere the pipe's EOF does it)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


# -- the server --------------------------------------------------------------------------
_warm_targets: set[str] = set()


# What every job imports, loaded once in the server: the job forks with them in place.
# Safe since a search's draws stopped depending on the modules loaded (Hypothesis mixed
# every loaded local module's constants into its draws; kvspec's searches draw without
# them: tests/test_campaign.py's warm-equals-fresh search is the regression test).
JOB_MODULES = ("kvspec.cli", "kvspec.check.command", "kvspec.check.search", "kvspec.check.minimize",
               "kvspec.mc.search", "kvspec.mc.command", "kvspec.corpus.command", "kvspec.corpus.runner")


def _warm(target: Optional[str]) -> None:
    """Load kvspec's checkers once, and the target's package the first time a job names
    it (torch for nano-vllm, about 20 s for vLLM), as ``kvspec patches`` does before it
    forks its trials."""
    import importlib

    for name in JOB_MODULES:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # the job imports it again and reports what goes wrong, in its own process
                pass
    if target and target not in _warm_targets:
        _warm_targets.add(target)
        try:
            from kvspec.targets.registry import load_target
            load_target(target)
        except BaseException:  # a target that does not load is the job's to report, in its own process
            pass


def _run_main(argv: list[str]) -> int:
    """``python -m kvspec ARGV``, in this process: runpy runs kvspec/__main__.py as
    ``__main__``, with its path as ``sys.argv[0]``, exactly as the interpreter's ``-m`` does."""
    import runpy

    sys.argv = ["kvspec", *argv]
    try:
        runpy.run_module("kvspec", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def _job_child(req: dict, server_fds: list[int]) -> None:
    code = 70  # EX_SOFTWARE: the child could not even start the command
    try:
        os.setpgid(0, 0)
        _die_with_parent()
        for fd in server_fds:  # the server's replies, socket and connections are not the job's
            try:
                os.close(fd)
            except OSError:
                pass
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        cwd = req["cwd"]
        for fd, name in ((1, "stdout"), (2, "stderr")):
            f = os.open(os.path.join(cwd, f".job.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        sys.stdin = open(0, closefd=False)
        os.chdir(cwd)
        atexit._clear()  # the server's exit handlers are not the job's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        code = _run_main(list(req["argv"]))
        atexit._run_exitfuncs()
    except BaseException as e:
        try:
            print(f"kvspec campaign: the warm job failed to run: {type(e).__name__}: {e}", file=sys.stderr)
        except BaseException:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reply(conn: socket.socket, code: Optional[int], timed_out: bool) -> None:
    try:
        conn.sendall((json.dumps({"exit_code": code, "timed_out": timed_out}) + "\n").encode())
    except OSError:
        pass
    conn.close()


def serve_node(path: str) -> int:
    """The node server's loop: jobs from any number of clients at once, each a request
    line on a connection of its own and a reply line when its job is done."""
    _die_with_parent()
    os.dup2(2, 1)  # anything a target prints while it loads goes to stderr
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    owner = sys.stdin.fileno()  # the driver writes nothing: readable is its EOF
    reading: dict[socket.socket, bytes] = {}          # connections whose request is not complete yet
    running: dict[int, tuple[socket.socket, float]] = {}  # job pid -> (its connection, deadline)
    try:
        while True:
            busy = [c for c, _ in running.values()]
            ready = select.select([owner, listener, *reading, *busy], [], [], POLL_S)[0]
            if owner in ready:
                return 0
            for s in ready:
                if s is listener:
                    conn, _ = listener.accept()
                    reading[conn] = b""
                elif s in reading:
                    data = s.recv(65536)
                    buf = reading.pop(s) + data
                    if not data:
                        s.close()
                    elif b"\n" not in buf:
                        reading[s] = buf
                    else:
                        req = json.loads(buf.split(b"\n", 1)[0])
                        _warm(req.get("target"))
                        sys.stdout.flush()
                        sys.stderr.flush()
                        pid = os.fork()
                        if pid == 0:
                            fds = [listener.fileno(), s.fileno(), *(c.fileno() for c in reading),
                                   *(c.fileno() for c, _ in running.values())]  # as of now, not the loop's start
                            _job_child(req, fds)
                        try:  # the child does it too: whichever runs first, the group exists before a kill
                            os.setpgid(pid, pid)
                        except OSError:
                            pass
                        running[pid] = (s, time.monotonic() + float(req["timeout"]))
                elif s.recv(1) == b"":  # a running job's client went away (its Ray worker died)
                    pid = next(p for p, (c, _) in running.items() if c is s)
                    _kill_group(pid)
                    os.waitpid(pid, 0)
                    del running[pid]
                    s.close()
            for pid, (conn, deadline) in list(running.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    _kill_group(pid)  # its trial workers, if it died without reaping them
                    del running[pid]
                    _reply(conn, os.waitstatus_to_exitcode(status), False)
                elif time.monotonic() > deadline:
                    _kill_group(pid)
                    os.waitpid(pid, 0)
                    del running[pid]
                    _reply(conn, 124, True)
    finally:
        for pid in running:
            _kill_group(pid)
        listener.close()


class NodeServer:
    """The driver's end of its node's server: started before Ray, stopped after it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.home = tempfile.mkdtemp(prefix="kvw-")  # short: a Unix socket path has ~100 characters
        self.path = os.path.join(self.home, "s")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvspec.campaign.warm", "--listen", self.path],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=self.home, env=env)

    def ready(self, seconds: float = 30.0) -> bool:
        """Whether it listens (it imports nothing before it binds: well under a second)."""
        end = time.monotonic() + seconds
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > end:
                return False
            time.sleep(POLL_S)
        return True

    def close(self) -> None:
        if self.proc.poll() is None:
            try:  # EOF: the server kills what still runs and exits
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.home, ignore_errors=True)


def run_on_node(path: str, argv: list[str], cwd: str, timeout: float,
                target: Optional[str]) -> Optional[tuple[Optional[int], str, str]]:
    """``WarmClient.run``'s answer from the node server at ``path``; None when there is no
    server to take the job (not started, gone): the caller runs it another way."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.sendall((json.dumps({"argv": argv, "cwd": cwd, "timeout": timeout, "target": target}) + "\n").encode())
    except OSError:
        s.close()
        return None
    buf, note = b"", ""
    try:
        s.settimeout(timeout + GRACE_S)
        while b"\n" not in buf:
            data = s.recv(4096)
            if not data:
                break
            buf += data
    except OSError:  # no answer in time: closing the connection makes the server kill the job
        note = f"\nkvspec campaign: the node's warm server gave no answer {timeout + GRACE_S:g} s into a " \
               f"{timeout:g} s job"
    finally:
        s.close()
    if b"\n" in buf:
        got = json.loads(buf.split(b"\n", 1)[0])
        code = got["exit_code"]
        if got.get("timed_out"):
            note = f"\nkvspec campaign: job killed after its {timeout:g} s job_timeout"
    else:
        code = None
        note = note or "\nkvspec campaign: the node's warm server closed the job's connection without an answer"
    return code, _read(Path(cwd) / ".job.stdout"), _read(Path(cwd) / ".job.stderr") + note


# -- the client, in a Ray worker ---------------------------------------------------------
class WarmClient:
    """A Ray worker's own server, where its node has none of the driver's: the same
    server (``NodeServer``), started on the worker's first job and kept from task to task;
    one that died or stopped answering is replaced for the next job."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.server: Optional[NodeServer] = None
        self.started = 0

    @property
    def proc(self) -> Optional[subprocess.Popen]:
        return self.server.proc if self.server is not None else None

    def stop(self) -> None:
        """Stop the server, and the jobs it runs with it."""
        if self.server is not None:
            self.server.close()
        self.server = None

    close = stop

    def run(self, argv: list[str], cwd: str, timeout: float, target: Optional[str]) -> tuple[int | None, str, str]:
        """(exit code, stdout, stderr) of ``kvspec ARGV`` run in ``cwd``; 124 past ``timeout``."""
        if self.server is None or self.server.proc.poll() is not None:
            self.stop()
            self.server = NodeServer(self.env)
            self.started += 1
        got = run_on_node(self.server.path, argv, cwd, timeout, target) if self.server.ready() else None
        if got is None or got[0] is None:  # no server to reach, or no answer: a new one for the next job
            died = self.server.proc.poll()
            self.stop()
            if got is None:
                return None, "", f"kvspec campaign: the warm worker exited (code {died}) before it took the job"
        return got


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


_client: Optional[WarmClient] = None


def client(env: dict[str, str]) -> WarmClient:
    """This process's one warm client (a Ray worker keeps it from task to task)."""
    global _client
    if _client is None:
        _client = WarmClient(env)
        atexit.register(_client.close)
    return _client


if __name__ == "__main__":
    sys.exit(serve_node(sys.argv[2]))
