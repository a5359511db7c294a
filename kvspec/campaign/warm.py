"""Warm jobs: a long-lived ``kvspec`` process that forks one child per job.

A fresh ``python -m kvspec`` per job pays the interpreter, kvspec's imports and the
target's package (torch for nano-vllm, about 20 s for vLLM) every time; on a small
machine that made a corpus campaign 1.25-1.34x slower than ``kvspec patches --jobs 2``.
A job that needs no environment of its own (no ``env``, no ``pythonpath``: everything
but a release tree) runs here instead:

- the *server* loads each target's package the first time a job names it
  (``load_target``, as ``kvspec patches`` does before it forks its trials), and nothing
  else of kvspec's (see ``_warm``: import order changes a search);
- each job is a ``fork`` of that warm server: the child runs ``python -m kvspec`` on
  the job's command line (``runpy``, as the interpreter's ``-m`` does), in the job's scratch directory, with stdout and stderr going
  to files. A job still gets a process of its own, so what it patches, the signal
  handlers it installs and the modules it loads never reach the next job: its verdict
  is the one the subprocess path gives.
- the time limit: the child leads a process group of its own (``kvspec patches``
  forks its trials under it); past its limit the server kills the whole group. If the
  server itself stops answering, the client kills it and the next job starts a new
  one. The server reads its requests from a pipe: when the Ray worker dies (a node
  killed), the pipe closes and the server kills its running job and exits; on Linux it
  and its job also get SIGKILL from the kernel when their parent dies (PR_SET_PDEATHSIG).

Two kinds of server, the same jobs:

- the *node server* (``NodeServer``, ``python -m kvspec.campaign.warm --listen SOCKET``):
  the driver starts one before Ray, on its own node, and every job of that node goes to
  it over a Unix socket, several at a time (``run_on_node``): its driver's early jobs
  and all its Ray workers'. One import of the target per node, as ``kvspec patches
  --jobs N`` pays one per run, and it overlaps Ray's start. A client that goes away
  (its Ray worker killed) closes its connection: the server kills that job. The server
  exits when the driver closes its stdin (or dies: PR_SET_PDEATHSIG).
- the *worker server* (``WarmClient``, ``python -m kvspec.campaign.warm``): on the other
  nodes of a cluster, each Ray worker starts one on its first job and keeps it, one job at
  a time over a pipe.

Only a server forks, never the Ray worker or the driver (processes with threads), and a
server starts no threads. Protocol: one JSON line per request
``{"argv", "cwd", "timeout", "target"}`` on stdin, one JSON line ``{"exit_code",
"timed_out"}`` per reply on the server's own copy of stdout (its fd 1 goes to stderr,
so that a target that prints while it loads cannot break a reply).
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


def _warm(target: Optional[str]) -> None:
    """Load the target's package the first time a job names it (torch for nano-vllm,
    about 20 s for vLLM), as ``kvspec patches`` does before it forks its trials. Nothing
    else: which kvspec modules are imported first changes what a search draws (measured:
    importing kvspec.mc.search before ``kvspec check --target impl --patch
    partial_cached.diff --seed 1 --max-examples 150`` makes it pass at 180 examples where a
    fresh process finds I3 at example 62), so the job imports kvspec's own modules in its
    own order, as a fresh process would."""
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


def _wait(pid: int, limit: float, stdin_fd: int) -> tuple[Optional[int], bool, bool]:
    """(exit code, timed out, the client went away) for the job child ``pid``."""
    deadline = time.monotonic() + limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _kill_group(pid)  # its trial workers, if it died without reaping them
            return os.waitstatus_to_exitcode(status), False, False
        # the client writes one request and waits for its reply: stdin readable now is its EOF
        gone = bool(select.select([stdin_fd], [], [], POLL_S)[0])
        if gone or time.monotonic() > deadline:
            _kill_group(pid)
            os.waitpid(pid, 0)
            return (None if gone else 124), not gone, gone


def serve() -> int:
    """The server's loop: one request line in, one reply line out, until stdin closes."""
    _die_with_parent()
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a target prints while it loads goes to stderr, not into a reply
    stdin_fd = sys.stdin.fileno()
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        req = json.loads(line)
        _warm(req.get("target"))
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _job_child(req, [reply.fileno()])
        code, timed_out, gone = _wait(pid, float(req["timeout"]), stdin_fd)
        if gone:
            return 0
        reply.write(json.dumps({"exit_code": code, "timed_out": timed_out}) + "\n")


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
                                   *(c.fileno() for c in busy)]
                            _job_child(req, fds)
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
    """The Ray worker's end: starts the server on first use, hands it one job at a time."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.home = tempfile.mkdtemp(prefix="kvspec-campaign-warm-")  # its cwd: no checkout's kvspec/ to shadow
        self.started = 0

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvspec.campaign.warm"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=self.home,
                                         env=self.env, text=True, bufsize=1)
            self.started += 1
        return self.proc

    def stop(self) -> None:
        """Stop the server, and the job it runs with it."""
        if self.proc is not None and self.proc.poll() is None:
            try:  # EOF first: the server kills its job's whole process group and exits
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.home, ignore_errors=True)

    def run(self, argv: list[str], cwd: str, timeout: float, target: Optional[str]) -> tuple[int | None, str, str]:
        """(exit code, stdout, stderr) of ``kvspec ARGV`` run in ``cwd``; 124 past ``timeout``."""
        proc = self._start()
        note = ""
        try:
            proc.stdin.write(json.dumps({"argv": argv, "cwd": cwd, "timeout": timeout, "target": target}) + "\n")
            proc.stdin.flush()
            ready = select.select([proc.stdout], [], [], timeout + GRACE_S)[0]
            line = proc.stdout.readline() if ready else ""
        except (OSError, ValueError):
            line = ""
        if line:
            got = json.loads(line)
            code = got["exit_code"]
            if got.get("timed_out"):
                note = f"\nkvspec campaign: job killed after its {timeout:g} s job_timeout"
        else:  # the server died or hung: a new one for the next job
            died = proc.poll()
            self.stop()
            code = None if died is not None else 124
            note = (f"\nkvspec campaign: the warm worker exited (code {died}) without an answer" if died is not None
                    else f"\nkvspec campaign: the warm worker gave no answer {timeout + GRACE_S:g} s into a "
                         f"{timeout:g} s job; killed")
        out = _read(Path(cwd) / ".job.stdout")
        err = _read(Path(cwd) / ".job.stderr") + note
        return code, out, err


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
    sys.exit(serve_node(sys.argv[2]) if sys.argv[1:2] == ["--listen"] else serve())
