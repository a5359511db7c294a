"""What a failed check reports: an invariant id, one sentence, and the state excerpt."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Violation:
    invariant: str   # a stable id from kvspec.spec.invariants.CATALOGUE
    message: str     # one sentence naming the blocks and requests involved
    excerpt: str = ""  # the part of the observed state that shows it
    # the last of what the target printed (stdout and stderr) during the run that found it;
    # not part of the finding's identity (two runs that print differently find the same thing)
    target_output: str = field(default="", compare=False)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"
