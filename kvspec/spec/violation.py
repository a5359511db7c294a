"""What a failed check reports: an invariant id, one sentence, and the state excerpt;
and a finding's signature (``signature``), what tells two distinct bugs apart."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class Violation:
    invariant: str   # a stable id from kvspec.spec.invariants.CATALOGUE
    message: str     # one sentence naming the blocks and requests involved
    excerpt: str = ""  # the part of the observed state that shows it
    # the last of what the target printed (stdout and stderr) during the run that found it;
    # not part of the finding's identity (two runs that print differently find the same thing)
    target_output: str = field(default="", compare=False)
    # where in the target's code it broke, where known: for NO_CRASH the innermost frame of
    # the target's own code ("BlockPool.get_new_blocks (block_pool.py:84)"); "" otherwise
    where: str = field(default="", compare=False)
    # a caller bug (kvspec.spec.blame): the target frame that passed a value its callee
    # rejected, on a valid sequence; "" otherwise
    caller: str = field(default="", compare=False)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


Signature = tuple  # (invariant, op kind, code location)


def signature(v: Violation, op: Optional[Any]) -> Signature:
    """A finding's signature: the invariant, the kind of operation that broke it (the
    op's class name, "construction" for a pool that fails as built) and the code location
    in the target that broke it (``Violation.where``: the innermost target frame of a
    NO_CRASH; "" for the other invariants, whose op kind stands for the target method
    the driver called). Two findings with one signature are one bug to ``kvspec check``:
    after a finding the search goes on with its signatures excluded."""
    return (v.invariant, "construction" if op is None else type(op).__name__, v.where)


def signature_text(sig: Signature) -> str:
    inv, op, where = sig
    return f"{inv} on {op}" + (f" at {where}" if where else "")
