"""Copy-on-write on a nano-vllm-shaped manager with ``fork(parent, child)`` over its own
Sequences (RichardHuang2006/Mini-vLLM's BlockManager: ``fork`` shares every block, the next
write into a shared partial block copies it, inside ``allocate(seq, 1)``).

The cache level has no fork op, so the nano driver runs the allocator level's probe
(``kvspec.alloc.cow.ForkProbe``) after each admission and decode step of a sequence P:
fork P into a fresh child C (a Sequence with P's tokens and computed count), write C's next
token as the manager's scheduler decodes it (``can_allocate(C, 1)`` / ``allocate(C, 1)``),
free C; the probe checks the tables, ref counts and free count (COPY_ON_WRITE). It runs
only where the manager is observed through ``kvspec_observe`` (the ref counts it reads)
and its ``fork`` takes two Sequences; the probe is built per run from the driver's
current manager, so a cloned driver never calls another's."""
from __future__ import annotations

from typing import Any, Optional

from kvspec.alloc.shapes import required
from kvspec.targets.names import OBSERVE_HOOK

FORK_NAMES = ("fork", "fork_sequence", "fork_seq")
CHILD_TOKEN = 7  # the child's written token: its value is never read


def fork_method(manager_cls: type) -> Optional[str]:
    """The manager's fork(parent, child) taking two Sequences, or None."""
    for name in FORK_NAMES:
        req = required(manager_cls, name)
        if req is not None and len(req) == 2:
            return name
    return None


def probe_fork(driver: Any, seq: Any) -> None:
    """Fork ``seq``, write into the child, free it; findings go to ``driver.fork_found``."""
    from kvspec.alloc.cow import ForkProbe
    from kvspec.targets.nano_sequence import table_ids
    if driver.fork_found:
        return  # one finding is enough
    mgr, name = driver.mgr, driver.fork_name

    def observed() -> dict:
        return getattr(mgr, OBSERVE_HOOK)()

    def append(child: Any) -> Any:
        driver.append(child, CHILD_TOKEN)
        if not driver._decode_alloc(child):
            driver.pop_token(child)
            return False
        return None

    child = driver.new_seq(list(driver._seq_get(seq, "token_ids") if driver.names.has(seq, "token_ids")
                                else list(seq)))
    driver._seq_set(child, "num_cached_tokens", driver._seq_get(seq, "num_cached_tokens"))
    probe = ForkProbe(lambda p, c: getattr(mgr, name)(p, c), append, lambda c: driver.call("deallocate", c),
                      lambda s: list(table_ids(driver._seq_get(s, "block_table"))),
                      lambda: observed().get("free_count", len(observed()["free"])),
                      lambda: ([row[0] for row in observed()["blocks"]]
                               if getattr(mgr, "kvspec_pool_refs", True) else None),  # no ref counts: not read
                      lambda v: v is False,
                      {"fork": name, "append_token": driver.meth["allocate"],
                       "free_sequence": driver.meth["deallocate"]}, False)
    probe.run(seq, child, len(seq), driver.bs)
    driver.fork_found += probe.found
