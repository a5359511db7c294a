"""Run a command line in a forked child, so that a run which ends early never looks like
success.

The code under test runs inside kvspec's process: a target (or a patched module) that
calls ``os._exit(0)``, a signal, or the out-of-memory killer would otherwise end
kvspec with whatever status that leaves (``os._exit(0)``: 0, nothing printed, a pass
to any CI reading the exit code). So the command runs in a forked child, and the
child tells the parent its exit code through a pipe once the command has returned.
A child that ends without having said so vanished: the parent prints one line saying
how (its exit status or the signal), prints ``{"verdict": "error", ...}`` under
``--json``, and exits with ``EXIT_ENDED`` (2, an error: never a pass).

Under ``--json`` the child's stdout goes to a private temporary file that the parent
copies out only for a command that completed, so stdout stays one JSON object even
when the child died half-way through writing it.

``fork``, not ``spawn``: the child starts from the parent's already-started
interpreter (a few milliseconds). ``KVSPEC_IN_PROCESS=1`` runs the command in the
process itself (a debugger, a profiler), without this protection.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
from typing import Callable, Optional, Sequence

EXIT_ENDED = 2  # a run whose process vanished: an error, as a target error is
IN_PROCESS_ENV = "KVSPEC_IN_PROCESS"
# The child has a process group of its own, so a signal meant for kvspec (Ctrl-C at the
# terminal, ``kill -INT PID``, a CI runner's SIGTERM) reaches the parent alone, and the
# parent passes it on once to the child's group (as the terminal would have, workers
# included). Had the child stayed in the terminal's group, a Ctrl-C would reach it twice.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCONT)


def _die_with_parent() -> None:
    """SIGKILL the child when the parent dies (Linux), so that killing ``kvspec`` (a CI
    timeout's SIGKILL) never leaves the search running on its own."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # sys.exit("message"), as the interpreter does
    return 1


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        why = ", as the out-of-memory killer sends" if sig == signal.SIGKILL else ""
        return f"killed by signal {name}{why}"
    return f"exit status {os.waitstatus_to_exitcode(status)} without a verdict"


def run_guarded(command: Callable[[], int], argv: Sequence[str],
                report: Callable[[str, Sequence[str]], int]) -> int:
    """``command()``'s exit code, run in a forked child; ``report(line, argv)`` (the
    CLI's one-line error, JSON included) when the child vanished before returning it."""
    if os.environ.get(IN_PROCESS_ENV) or not hasattr(os, "fork"):
        return command()
    as_json = "--json" in argv
    out = tempfile.TemporaryFile() if as_json else None
    r, w = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    child: list[int] = []  # set once forked: a signal before that is passed on after
    pending: list[int] = []

    def forward(signum, frame):
        if not child:
            pending.append(signum)
            return
        try:
            os.killpg(child[0], signum)
        except OSError:
            try:
                os.kill(child[0], signum)
            except OSError:
                pass

    def suspend(signum, frame):  # Ctrl-Z: stop the child's group too, then this process
        forward(signal.SIGTSTP, frame)
        os.kill(os.getpid(), signal.SIGSTOP)

    # Set before the fork, so that no signal finds the parent without them.
    saved = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    saved[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, suspend)
    pid = os.fork()
    if pid == 0:  # the child: run the command, then say it finished
        for sig, old in saved.items():
            signal.signal(sig, old)
        os.close(r)
        _own_group(0)
        _die_with_parent()
        if out is not None:
            os.dup2(out.fileno(), 1)
        try:
            code = command()
        except SystemExit as e:  # argparse's --help and usage errors
            code = _exit_code(e)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.write(w, f"{os.getpid()} {code}\n".encode())
        os.close(w)
        return code  # the child leaves as the command line would (exit handlers run)
    os.close(w)
    _own_group(pid)  # both sides set it: whichever runs first, no signal finds it unset
    child.append(pid)
    for signum in pending:
        forward(signum, None)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
    return _outcome(pid, status, r, out, argv, report)


def _own_group(pid: int) -> None:
    try:
        os.setpgid(pid, pid)
    except OSError:  # the child already did it, or already left
        pass


def _outcome(pid: int, status: int, r: int, out, argv: Sequence[str],
             report: Callable[[str, Sequence[str]], int]) -> int:
    # Read only now, without blocking: a worker the child forked may still hold the pipe open.
    os.set_blocking(r, False)
    said = b""
    try:
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            said += chunk
    except BlockingIOError:
        pass
    os.close(r)
    code: Optional[int] = None
    for line in said.decode(errors="replace").splitlines():
        who, _, value = line.partition(" ")
        if who == str(pid) and value.lstrip("-").isdigit():
            code = int(value)
    if code is None:
        command = next((x for x in argv if not x.startswith("-")), "command")
        return report(f"kvspec: error: kvspec {command} ended before it finished ({_how(status)}): the code under "
                      f"test ended the process (os._exit, a signal) or memory ran out; no verdict", argv)
    if out is not None:  # the command finished: its one JSON object goes out now
        out.seek(0)
        sys.stdout.flush()
        try:
            while True:
                chunk = out.read(1 << 16)
                if not chunk:
                    break
                sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        finally:
            out.close()
    return code
