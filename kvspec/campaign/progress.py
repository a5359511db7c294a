"""The progress line on stderr: jobs done, running and failed, and the time left.

On a terminal one live line; otherwise (CI logs, a redirected run) one line per
finished job. The time left is the mean wall time of this run's finished jobs times
the jobs left, over the jobs that run at once: a rough figure, said as one.
"""
from __future__ import annotations

import sys
import time
from typing import Optional


def _clock(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


class Progress:
    def __init__(self, total: int, skipped: int, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.total, self.skipped = total, skipped
        self.done = skipped
        self.failed = 0
        self.running = 0
        self.start = time.monotonic()
        self.walls: list[float] = []

    def eta(self, slots: int) -> Optional[float]:
        if not self.walls:
            return None
        left = self.total - self.done
        return sum(self.walls) / len(self.walls) * left / max(1, slots)

    def line(self, slots: int, last: str = "") -> str:
        eta = self.eta(slots)
        return (f"[campaign] {self.done}/{self.total} done ({self.skipped} from earlier runs), {self.running} running, "
                f"{self.failed} failed, elapsed {_clock(time.monotonic() - self.start)}"
                + (f", about {_clock(eta)} left" if eta is not None else "") + (f"  {last}" if last else ""))

    def update(self, running: int, slots: int, finished: Optional[dict] = None) -> None:
        self.running = running
        last = ""
        if finished is not None:
            self.done += 1
            self.walls.append(float(finished.get("seconds") or 0.0))
            if finished.get("verdict") == "error":
                self.failed += 1
            last = f"{finished.get('label') or finished.get('id')}: {finished.get('verdict')}"
        if self.tty:
            self.stream.write("\r\033[K" + self.line(slots, last))
        elif finished is not None:
            self.stream.write(self.line(slots, last) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
