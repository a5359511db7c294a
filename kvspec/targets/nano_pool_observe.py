"""Observing a nano-vllm-shaped manager that keeps no nano-vllm internals (``blocks``,
``free_block_ids``) but owns a free-list pool (RichardHuang2006/Mini-vLLM's BlockManager:
``self.pool``, a ref-counted ``BlockPool``, and the tables on its own Sequences).

kvspec finds the pool among the manager's fields with the allocator level's shape
inference (``kvspec.alloc.shapes``: a free-list allocator, its free list, ref counts and
free count) and subclasses the manager with a ``kvspec_observe`` hook that reads them
(``kvspec.targets.names``). No prefix index: prefix caching is off for such a manager."""
from __future__ import annotations

from typing import Any, Optional


def find_pool(mgr: Any) -> Optional[tuple[str, Any]]:
    """(field name, the allocator map with its internals filled) of the first field of
    ``mgr`` that is a free-list allocator kvspec can read (free list or ref counts)."""
    from kvspec.alloc.shapes import FREE_LIST, fill_fields, infer
    for name, value in vars(mgr).items():
        if value is None or isinstance(value, (int, float, str, bytes, list, dict, tuple, set)):
            continue
        amap = infer(type(value))
        if amap is None or amap.shape != FREE_LIST:
            continue
        n = _num_blocks(value)
        if n is None:
            continue
        fill_fields(amap, value, n)
        if amap.get("free_ids") or amap.get("ref_counts"):
            return name, amap
    return None


def _num_blocks(pool: Any) -> Optional[int]:
    for attr in ("num_blocks", "_num_blocks", "num_total_blocks", "capacity", "size"):
        v = getattr(pool, attr, None)
        if type(v) is int and v > 0:
            return v
    return None


def observe_through_pool(cls: type, probe: Any) -> Optional[type]:
    """A subclass of ``cls`` whose ``kvspec_observe`` reads its pool, or None if it has none."""
    found = find_pool(probe)
    if found is None:
        return None
    field, amap = found
    m = dict(amap.methods)

    def kvspec_observe(self: Any) -> dict:
        from kvspec.alloc.pool_driver import read_free
        pool = getattr(self, field)
        n = _num_blocks(pool)
        free = read_free(getattr(pool, m["free_ids"])) if m.get("free_ids") else None
        if m.get("ref_counts"):
            refs = [int(r) for r in getattr(pool, m["ref_counts"])]
        else:
            refs = [0 if b in set(free) else 1 for b in range(n)]
        if free is None:
            free = [b for b in range(n) if refs[b] == 0]
        out = {"blocks": [(refs[b], None, []) for b in range(n)], "free": free, "index": {}}
        if m.get("num_free"):
            v = getattr(pool, m["num_free"])
            out["free_count"] = int(v() if callable(v) else v)
        return out

    return type(cls.__name__, (cls,), {"kvspec_observe": kvspec_observe, "__module__": cls.__module__,
                                       "__doc__": cls.__doc__, "kvspec_pool_field": field,
                                       "kvspec_pool_refs": bool(m.get("ref_counts"))})
