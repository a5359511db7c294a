"""Hand the pending jobs to Ray and collect their records as they finish.

Ray is imported here, lazily, and only by ``kvspec campaign``: importing it takes
seconds, which no other command should pay. Each job is one Ray task of one CPU; a
task whose node or worker process dies is run again by Ray itself (``max_retries``,
system failures only: a job that ran and gave an error is an answer, not retried).
Before Ray, this process starts its node's warm server (``kvspec.campaign.warm``):
every job of this node is forked from it, so a target is imported once per node, not
once per Ray worker. While a local Ray instance starts, this process runs the first
jobs itself (``_WhileRayStarts``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import socket
import sys
import threading
import time
from typing import Callable, Optional, Sequence

from kvspec.campaign.matrix import Job
from kvspec.campaign.runner import warm_eligible
from kvspec.campaign.warm import NodeServer
from kvspec.errors import UsageError

INSTALL_HINT = "pip install 'ray==2.60.0' (or pip install -e '.[test]' in a checkout)"


def require_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        raise UsageError(f"kvspec campaign needs Ray, which is not installed: {INSTALL_HINT}")


def _run_remote(job_d: dict, timeout: float, warm: bool = True, node: Optional[tuple[str, str]] = None) -> dict:
    # ``node``: (the driver's node id, its node server's socket). A task on that node forks
    # its job from there; elsewhere, Ray reuses a worker process from task to task, and
    # the warm server it starts with its first job (kvspec.campaign.warm) serves the next ones
    from kvspec.campaign.runner import run_job
    server = None
    if node is not None:
        import ray
        with contextlib.suppress(Exception):
            server = node[1] if ray.get_runtime_context().get_node_id() == node[0] else None
    return run_job(job_d, timeout, warm, server)


def _lost(job: Job, error: BaseException, retries: int) -> dict:
    """The record of a job Ray gave up on (its node died more than ``retries`` times)."""
    msg = " ".join(str(error).split())[:500]
    return {"id": job.id, "label": job.label, "command": job.command, "argv": ["kvspec", *job.argv(), "--json"],
            "env": job.env, "pythonpath": list(job.pythonpath), "exit_code": None, "verdict": "error",
            "error": f"ray gave up on the task after {retries} retries: {type(error).__name__}: {msg}",
            "seconds": 0.0, "node": None, "result": None, "repros": {}, "stderr_tail": ""}


def _reachable(address: Optional[str], seconds: float = 10.0) -> None:
    """A HOST:PORT nobody listens on is one line now, not minutes of Ray's reconnecting."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\]/]+?)\]?:(\d+)", address or "")
    if not m:
        return  # "auto", a local instance, or a form Ray resolves itself
    try:
        socket.create_connection((m.group(1), int(m.group(2))), timeout=seconds).close()
    except (OSError, ValueError) as e:
        raise UsageError(f"kvspec campaign: no Ray cluster answers at {address}: {e.strerror or e} "
                         f"(start one with: ray start --head --port=PORT)") from None


def connect(address: Optional[str]):
    """ray.init on ``address`` (a local instance when None); returns (ray, started_here)."""
    require_ray()
    import ray

    if ray.is_initialized():  # a caller (a test, a notebook) brought its own Ray: use it, leave it running
        return ray, False
    _reachable(address)
    try:
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR, configure_logging=True)
    except Exception as e:  # ConnectionError, ValueError, RuntimeError: which one varies with the release
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise UsageError(f"kvspec campaign: cannot start or reach {where}: {' '.join(str(e).split())[:300]}") from None
    return ray, True


@contextlib.contextmanager
def stdout_to_stderr():
    """While Ray runs, what it prints (``(raylet) Task ... will be retried``) goes to stderr:
    under ``--json`` stdout holds one JSON object and nothing else."""
    sys.stdout.flush()
    saved = None
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except (OSError, ValueError):  # no real fd 1 (a captured stream): the Python-level swap still holds
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def execute(jobs: Sequence[Job], address: Optional[str], timeout: float, retries: int,
            on_done: Callable[[dict, int, int], None], on_start: Optional[Callable[[int, int], None]] = None,
            warm: bool = True) -> None:
    """Run ``jobs`` as Ray tasks; ``on_done(record, running, slots)`` for each as it finishes."""
    with stdout_to_stderr():
        _execute(jobs, address, timeout, retries, on_done, on_start, warm)


class _WhileRayStarts:
    """Starting a local Ray instance takes 8 to 13 s on a 2-core machine (GCS, raylet and
    its agents, each a Python process importing Ray), about half a core busy: this process
    runs the first jobs itself meanwhile, one at a time, the way a Ray worker would
    (``run_job``, warm), and stops taking new ones once Ray is up; until the job it runs
    then is done, Ray gets one job fewer than its CPUs. Only for a local instance: on a
    cluster, connecting is quick and the driver may be no place for jobs."""

    def __init__(self, jobs: Sequence[Job], timeout: float, warm: bool, on_done: Callable[[dict], None],
                 node_server: Optional[str] = None) -> None:
        self.queue = list(jobs)
        self.lock = threading.Lock()
        self.timeout, self.warm, self.on_done, self.node_server = timeout, warm, on_done, node_server
        self.ran = 0
        self.busy = False  # a job of its own is running now: the progress line counts it
        self.thread = threading.Thread(target=self._run, name="kvspec-while-ray-starts", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from kvspec.campaign.runner import run_job
        while True:
            with self.lock:
                if not self.queue:
                    return
                job = self.queue.pop(0)
                self.busy = True
            record = run_job(job.to_dict(), self.timeout, self.warm, self.node_server)
            self.busy = False
            record["ran_on"] = "driver, while Ray started"
            self.ran += 1
            self.on_done(record)

    def rest(self) -> list[Job]:
        """Stop taking jobs; the ones not taken (the job it runs now finishes here)."""
        with self.lock:
            rest, self.queue = self.queue, []
        return rest

    def finish(self) -> None:
        self.thread.join()
        from kvspec.campaign import warm
        if warm._client is not None:  # this process's warm server has no more jobs
            warm._client.close()
            warm._client = None


def running_now(in_ray: int, slots: int, early: Optional[_WhileRayStarts]) -> int:
    """Jobs running now, for the progress line: Ray's (at most its CPUs) and the one the
    driver runs itself while Ray starts."""
    return min(in_ray, slots) + (1 if early is not None and early.busy else 0)


def _execute(jobs: Sequence[Job], address: Optional[str], timeout: float, retries: int,
             on_done: Callable[[dict, int, int], None], on_start: Optional[Callable[[int, int], None]],
             warm: bool = True) -> None:
    require_ray()
    done_lock = threading.Lock()
    slots = 1
    in_ray = 0  # jobs handed to Ray and not yet back

    def done(record: dict) -> None:
        with done_lock:
            on_done(record, running_now(in_ray, slots, early), slots)

    early = server = None
    if warm and any(warm_eligible(j) for j in jobs):
        # the node server: one import of each target for every job of this node, while Ray starts
        server = NodeServer({k: v for k, v in os.environ.items() if k != "KVSPEC_DEBUG"})
        if not server.ready():
            server.close()
            server = None  # each Ray worker then starts a server of its own, as on other nodes
    ours = "ray" not in sys.modules or not sys.modules["ray"].is_initialized()  # else a caller's Ray is up already
    if address is None and ours and jobs:
        early = _WhileRayStarts(jobs, timeout, warm, done, server and server.path)
        if on_start:
            on_start(1, 1)
    try:
        ray, started_here = connect(address)
    except BaseException:
        if early:
            early.rest()
        if server:
            server.close()
        raise
    try:
        queue = early.rest() if early else list(jobs)
        node = None
        if server:
            with contextlib.suppress(Exception):  # a driver that is no node of the cluster: no sharing
                node = (ray.get_runtime_context().get_node_id(), server.path)
        task = ray.remote(num_cpus=1, max_retries=retries, retry_exceptions=False)(_run_remote)
        refs: dict = {}
        pending: list = []
        slots = max(1, int(ray.cluster_resources().get("CPU", 1)))
        if on_start:
            on_start(min(len(queue), slots), slots)
        while queue or pending:
            # while this process still runs a job of its own, Ray gets one job fewer than its
            # CPUs: a core each, as kvspec patches --jobs gives its trials (a timed trial on a
            # shared core would search less in its seconds); then every job left, at once
            driver_busy = early is not None and early.thread.is_alive()
            room = max(0, slots - 1 - len(pending)) if driver_busy else len(queue)
            for job in queue[:room]:
                ref = task.remote(job.to_dict(), timeout, warm, node)
                refs[ref] = job
                pending.append(ref)
            del queue[:room]
            in_ray = len(pending)
            if not pending:
                time.sleep(0.2)
                continue
            ready, pending = ray.wait(pending, num_returns=1, timeout=0.5 if driver_busy else 10.0)
            in_ray = len(pending)
            if not ready:
                slots = max(1, int(ray.cluster_resources().get("CPU", slots)))  # nodes come and go
                continue
            for ref in ready:
                job = refs[ref]
                try:
                    record = ray.get(ref)
                except Exception as e:  # RayTaskError, WorkerCrashedError, NodeDiedError, ...
                    record = _lost(job, e, retries)
                done(record)
        if early:
            early.finish()
    finally:
        if started_here:
            t0 = time.monotonic()
            ray.shutdown()
            logging.getLogger(__name__).debug("ray.shutdown took %.1f s", time.monotonic() - t0)
        if server:
            server.close()
