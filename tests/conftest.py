"""Suite-wide set-up.

Triton's interpreter must be selected before triton is first imported, and vLLM imports
triton on its own. Test modules are collected in an order we do not control across
xdist workers, so the choice is made here, once, before any test module is imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
