"""KV_INTEGRITY on the KV tensors an allocator owns (issue 31).

Where an allocator keeps its KV cache itself (``self.k_cache``, ``self.v_cache``, a list of
per-layer tensors...), kvspec writes into the slots it hands out what a model would write
there, and reads them back: a block (a token's slot, for a sequence) must still hold what
its holder wrote. An allocator whose own code writes into a block someone holds (a free
that clears a neighbour, a copy into the wrong block) is found there, where the tables
alone look right.

Which tensors: the torch tensors among the allocator's attributes (also inside a list or
tuple, one per layer) with a dimension of the run's block count followed by one of its
block size; the first such pair is the (block, slot) index. What is written: a marker
(a small integer, exact in float16) per write, filling the slot (every layer, head and
channel). Nothing is written where no tensor fits: then this check has nothing to say."""
from __future__ import annotations

import itertools
from typing import Any, Optional

KV = "KV_INTEGRITY"


def _tensors(value: Any) -> list:
    try:
        import torch
    except ImportError:  # no torch: an allocator cannot own torch tensors
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(x, torch.Tensor) for x in value):
        return list(value)
    return []


def find(obj: Any, num_blocks: int, block_size: int) -> list[tuple[str, Any, int]]:
    """(attribute, tensor, index of its block dimension) for each KV tensor of ``obj``."""
    out = []
    attrs = vars(obj) if hasattr(obj, "__dict__") else {}
    for name, value in attrs.items():
        for i, t in enumerate(_tensors(value)):
            if not t.is_floating_point():
                continue  # block tables, slot mappings: ints
            shape = tuple(t.shape)
            dim = next((d for d in range(len(shape) - 1) if shape[d] == num_blocks and shape[d + 1] == block_size),
                       None)
            if dim is not None:
                out.append((f"{name}[{i}]" if isinstance(value, (list, tuple)) else name, t, dim))
    return out


class KVShadow:
    """What each held slot must read: ``(block, slot) -> marker``; slot None: the whole block."""

    def __init__(self, tensors: list[tuple[str, Any, int]]) -> None:
        self.tensors = tensors
        self.expect: dict[tuple[int, Optional[int]], tuple[float, str]] = {}
        self.markers = itertools.count(1)

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def _index(self, dim: int, block: int, slot: Optional[int]) -> tuple:
        return (slice(None),) * dim + ((block,) if slot is None else (block, slot))

    def write(self, block: int, slot: Optional[int], who: str) -> None:
        m = float(next(self.markers) % 2000 + 1)
        for _, t, dim in self.tensors:
            t[self._index(dim, block, slot)] = m
        self.expect[(block, slot)] = (m, who)

    def forget(self, block: int) -> None:
        for key in [k for k in self.expect if k[0] == block]:
            del self.expect[key]

    def forget_where(self, keep: set) -> None:
        """Forget every slot whose (block, slot) is not in ``keep``."""
        for key in [k for k in self.expect if k not in keep]:
            del self.expect[key]

    def problems(self) -> list[tuple[str, str]]:
        for (block, slot), (m, who) in sorted(self.expect.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            for name, t, dim in self.tensors:
                got = t[self._index(dim, block, slot)]
                if not bool((got == m).all()):
                    where = f"block {block}" + ("" if slot is None else f" slot {slot}")
                    seen = got.flatten()[0].item()
                    return [(KV, f"{where} of {name} holds KV written for {who}, still its holder, but reads "
                                 f"{seen:g}, not that KV: the allocator wrote into a block someone holds")]
        return []
