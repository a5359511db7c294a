"""Bytes a state costs the model checker's seen set, exact keys against fingerprints (issue 33).

    python benchmarks/mc_memory.py

For a few small configurations, runs ``model_check`` with ``seen="exact"`` (the canonical
keys as marshalled bytes in a Python set: the seen set before issue 33) and with
``seen="fingerprint"`` (kvspec.mc.fingerprint), checks that the two find the same states,
and prints the seen set's bytes per state: ``sys.getsizeof`` of the set plus that of
every key (the exact one; shared objects counted once), against the fingerprint table's
``nbytes``. Deterministic (no timing), so it runs on a loaded machine.
"""
from __future__ import annotations

import json
import sys

from kvspec.mc import search
from kvspec.mc.enumerate_ops import Bounds
from kvspec.mc.search import model_check
from kvspec.spec.config import Config
from kvspec.targets import load_target

CONFIGS = [
    ("pool, 4 blocks, depth 6, symmetry on", Config(level="pool", num_blocks=5), 6, Bounds()),
    ("pool, 3 blocks, depth 6, symmetry off", Config(level="pool", num_blocks=4), 6, Bounds(symmetry=False)),
    ("cache, 3 blocks, depth 5", Config(level="cache", num_blocks=4, block_size=2), 5, Bounds()),
    ("hybrid (full,swa:4), 3 blocks, depth 4",
     Config(level="cache", num_blocks=4, block_size=2, kv_groups="full,swa:4"), 4, Bounds()),
]


def main() -> int:
    t = load_target("impl")
    captured: dict = {}
    real = search._Search.close

    def keep(self):   # the seen set as the search left it
        captured["seen"] = self.seen
        real(self)
    search._Search.close = keep
    rows = []
    for name, cfg, depth, bounds in CONFIGS:
        ex = model_check(t, cfg, depth, bounds, seen="exact", frontier="memory")
        keys = captured["seen"]
        exact_bytes = sys.getsizeof(keys) + sum(sys.getsizeof(k) for k in keys)
        fp = model_check(t, cfg, depth, bounds, seen="fingerprint", frontier="memory")
        assert (fp.states, fp.levels) == (ex.states, ex.levels), name
        rows.append({"config": name, "states": ex.states, "exact_bytes_per_state": round(exact_bytes / ex.states, 1),
                     "fingerprint_bytes_per_state": round(fp.seen_bytes / fp.states, 1),
                     "collision_optimistic": fp.collision["optimistic"]})
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
