"""The one tolerance rule for kernel outputs, as FlashAttention's tests state it.

The kernel's error against the float64 oracle may be at most twice the error of the
same maths done in the input dtype (``reference.paged_attention(...,
compute_dtype=dtype)``), plus a small absolute floor per dtype. Errors are the
maximum over the whole output, as FlashAttention measures them.

Why a floor: when the low-precision reference happens to be nearly exact (one key,
so the output is a copy of V; or tiny scores), twice its error is no allowance at
all, yet the kernel still rounds differently (another summation order in the dot
products, an online softmax that rescales per tile). For fp16 and bf16 the floor is
one machine epsilon, about one unit in the last place at the unit magnitude of the
test data. For fp32 it is 1e-5: with peaky test scores (|s| up to ~15) the fp32 dot
products alone are off by ~1e-6 in either implementation, and 2x of one rounding
pattern does not bound another. Every bug in the kernel corpus misses by orders of
magnitude more (or yields NaN).
"""
from __future__ import annotations

import math

import torch

# Absolute floor per input dtype (machine epsilon: fp32 1.2e-7, fp16 9.8e-4, bf16 7.8e-3).
FLOOR: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}
FACTOR = 2.0


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in float64; NaN or inf anywhere gives inf (a trap was read)."""
    if a.numel() == 0:
        return 0.0
    diff = (a.detach().cpu().double() - b.detach().cpu().double()).abs()
    if not torch.isfinite(diff).all():
        return math.inf
    return diff.max().item()


def bound(ref_lowp_err: float, dtype: torch.dtype) -> float:
    """The largest error allowed to a kernel whose input dtype is ``dtype``."""
    if dtype not in FLOOR:
        raise ValueError(f"no tolerance for {dtype}; known: {', '.join(map(str, FLOOR))}")
    return FACTOR * ref_lowp_err + FLOOR[dtype]


def check_close(out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor,
                dtype: torch.dtype) -> tuple[bool, float, float]:
    """(ok, kernel error, bound): ``out`` against the float64 ``ref64``, allowed by ``ref_lowp``."""
    err = max_abs_err(out, ref64)
    lowp = max_abs_err(ref_lowp, ref64)
    allowed = bound(lowp if math.isfinite(lowp) else 0.0, dtype)
    return err <= allowed, err, allowed
