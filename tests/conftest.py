"""Suite-wide set-up.

Triton's interpreter must be selected before triton is first imported, and vLLM imports
triton on its own. Test modules are collected in an order we do not control across
xdist workers, so the choice is made here, once, before any test module is imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis mixes literal constants from every local module in sys.modules into its draws
# (kvspec is installed editable, and the test files are local too), so which modules an
# xdist worker happened to import first changed what a seeded or derandomized test drew.
# kvspec's own searches draw without them (kvspec.check.search.draws_independent_of_loaded_modules);
# the tests that drive the machines directly get the same, for the whole session.
from kvspec.check.search import draws_independent_of_loaded_modules  # noqa: E402

_no_local_constants = draws_independent_of_loaded_modules()
_no_local_constants.__enter__()
