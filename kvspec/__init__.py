"""kvspec: a verification suite and model checker for paged KV-cache block allocators.

The packages follow the path of one step (see the README, "How kvspec is built"):

    spec      ops, observation, config, reference models, invariant catalogue (imports no other package)
    targets   one adapter per allocator family: op -> the allocator's API, its state -> Observation
    check     session (one step: target + model + invariants), Hypothesis search, ddmin, repros, replay
    mc        exhaustive breadth-first model checking over the same session
    corpus    the bundled bug corpora (package data) and ``kvspec patches``
    report    text, Markdown, JSON, JUnit and figures
    cli       argument parsing and dispatch only; nothing imports it

``errors`` and ``patching`` are leaf modules every package may import.
"""
from __future__ import annotations

import os as _os

from ._moved import install as _install_moved

_install_moved()

# Run from a source checkout on PYTHONPATH (tools/vllm_releases.py runs each release that way),
# kvspec.impl, kvspec.kernels and kvspec.stateful live beside this package (pyproject's
# package-dir), not inside it: look there too, so they come from the same checkout as kvspec.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(__path__[0], "stateful"))
        and _os.path.isfile(_os.path.join(_root, "stateful", "__init__.py"))):
    __path__.append(_root)
