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


def ray_cpu_seconds() -> tuple[float, int]:
    """(user + system CPU-seconds, processes) of every process whose command line names ray."""
    total, n, tick = 0.0, 0, os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            if b"ray" not in open(f"/proc/{pid}/cmdline", "rb").read():
                continue
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
        n += 1
    return total, n


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
    start, n = ray_cpu_seconds()
    print(f"start and two tasks: {time.monotonic() - t:.1f} s wall, {start:.2f} CPU-seconds in {n} Ray processes")
    time.sleep(idle)
    end, n = ray_cpu_seconds()
    print(f"idle {idle:g} s: {end - start:.2f} CPU-seconds in {n} Ray processes "
          f"({(end - start) / idle * 60:.2f} a minute)")
    ray.shutdown()


if __name__ == "__main__":
    main()
