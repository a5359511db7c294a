"""Triton kernels that read the allocator's block tables (contract: DESIGN.md, "Kernels").

Without CUDA the kernels run under Triton's interpreter. It must be chosen before
triton is first imported, because triton.language's own helpers (tl.zeros, ...) are
decorated at that import.

This folder installs as ``kvspec.kernels``. When the repository root is on sys.path
(``python -m pytest`` from a checkout) it is also visible as a top-level ``kernels``,
a name that transformers probes for the unrelated Hugging Face ``kernels`` package.
Under that name (only; kvspec's patched copies load under names of their own) the module stays empty, so the probe sees "no usable version" instead
of importing Triton or raising.
"""
from __future__ import annotations

import os
import sys

if __name__ != "kernels":
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:  # too late to switch: fail clearly rather than deep inside a launch
            raise ImportError("kvspec.kernels: no CUDA, so the kernels need Triton's interpreter, but triton was "
                              "imported before TRITON_INTERPRET=1 was set; set it in the environment or import "
                              "kvspec.kernels first")
        os.environ["TRITON_INTERPRET"] = "1"

    # Relative on purpose: the kernel bug corpus loads patched copies of this package
    # under fresh names (sweep.load_patched_kernels), and an absolute kvspec.kernels
    # import would hand those copies the unpatched kernels (every bug "passes").
    from . import reference  # noqa: E402
    from .paged_attention import paged_attention  # noqa: E402
    from .write_kv import write_kv  # noqa: E402

    __all__ = ["paged_attention", "write_kv", "reference"]
else:
    __all__: list[str] = []
