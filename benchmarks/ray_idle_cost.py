"""What a local Ray instance costs on this machine, with the options ``kvspec campaign``
starts it with: CPU-seconds to start it and run two tasks, then CPU-seconds of all its
processes over an idle minute (from /proc; Linux). On a 2-core machine that is the part
of a campaign's wall time that ``kvspec patches --jobs 2`` does not pay.

    python benchmarks/ray_idle_cost.py [--idle 60]
"""
from __future__ import annotations

import argparse
import logging
import os
import time


def ray_processes() -> dict[int, tuple[str, float]]:
    """pid -> (short name, user + system CPU-seconds) of every process whose command line names ray."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            if b"ray" not in cmd:
                continue
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        words = [w.decode(errors="replace").rsplit("/", 1)[-1] for w in cmd.split(b"\0")[:3]]
        name = next((w for w in words if w.endswith(".py")), words[0])  # python -u log_monitor.py -> log_monitor.py
        out[int(pid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=float, default=60.0, help="idle seconds to measure")
    idle = ap.parse_args().idle
    import ray

    t = time.monotonic()
    ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
             configure_logging=True)

    @ray.remote
    def one() -> int:
        return 1

    ray.get([one.remote(), one.remote()])
    before = ray_processes()
    start = sum(c for _, c in before.values())
    print(f"start and two tasks: {time.monotonic() - t:.1f} s wall, {start:.2f} CPU-seconds in {len(before)} Ray processes")
    time.sleep(idle)
    after = ray_processes()
    end, n = sum(c for _, c in after.values()), len(after)
    print(f"idle {idle:g} s: {end - start:.2f} CPU-seconds in {n} Ray processes "
          f"({(end - start) / idle * 60:.2f} a minute)")
    per = sorted(((c - before.get(pid, (name, 0.0))[1]) / idle * 60, name) for pid, (name, c) in after.items())
    print("  a minute, by process: " + ", ".join(f"{name} {m:.2f}" for m, name in reversed(per)))
    ray.shutdown()


if __name__ == "__main__":
    main()
