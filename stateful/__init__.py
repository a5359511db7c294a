"""Hypothesis RuleBasedStateMachines, generic over targets.

``machines_for("mypkg.pool:BlockPool")`` returns a unittest-style TestCase class
that runs kvspec's machines on that target; assign it to a ``Test*`` name in a
test module and pytest collects it::

    from kvspec.stateful import machines_for
    TestMyPool = machines_for("mypkg.pool:BlockPool")

It has ``test_pool`` and/or ``test_cache``, one per level the target supports. The
run follows the kvspec pytest options (``--kvspec-level``, ``--kvspec-budget``,
``--kvspec-profile``, ...; see ``kvspec.pytest_plugin``); a failure names the
invariant and the repro file, as ``kvspec check`` does.
"""
from __future__ import annotations

import re
import unittest
from typing import Any, Optional

from kvspec.stateful.base import InvariantViolation, KVMachine, violation_error
from kvspec.stateful.cache import CacheMachine, cache_machine
from kvspec.stateful.pool import PoolMachine, pool_machine

__all__ = ["InvariantViolation", "KVMachine", "violation_error", "PoolMachine", "CacheMachine",
           "pool_machine", "cache_machine", "machines_for"]


def machines_for(target: Any, *, level: str = "all", api: Optional[str] = None, patch: Optional[str] = None,
                 profile: Optional[str] = None, budget: Optional[float] = None) -> type:
    """A ``unittest.TestCase`` class running kvspec's machines against ``target``.

    ``target`` is a target spec (``impl``, ``vllm``, ``nanovllm[:PKG]``,
    ``FILE.py:NAME``, ``module:NAME``) or a loaded ``kvspec.targets.Target`` (its
    repro files then name ``target.name``). It is loaded here, with ``patch`` (a
    unified diff) applied when given, so a target that cannot be loaded fails the
    test module's import with one clear line. ``level``, ``profile`` and ``budget``
    fix what this class runs; left at their defaults, the pytest options decide.
    """
    from kvspec.pytest_plugin import levels_to_run
    from kvspec.targets import Target, load_target

    if level not in ("pool", "cache", "all"):
        raise ValueError(f"level must be pool, cache or all, not {level!r}")
    if isinstance(target, Target):
        tgt, spec = target, target.name
    else:
        spec = str(target)
        tgt = load_target(spec, patch=patch, api=api)
    levels = levels_to_run(tgt, level)
    if not levels:
        raise ValueError(f"target {spec} supports the {', '.join(tgt.traits.levels)} level(s), not {level}")

    def make(lv: str):
        def test(self) -> None:
            from kvspec.pytest_plugin import KvspecFailure, active_options, run_machine, under_pytest

            opts = active_options()
            if opts.level not in ("all", lv):
                self.skipTest(f"--kvspec-level {opts.level} leaves out the {lv} machine")
            fixed = {k: v for k, v in (("profile", profile), ("budget", budget)) if v is not None}
            if fixed:
                from dataclasses import replace
                opts = replace(opts, **fixed)
            text = None
            try:
                run_machine(tgt, spec, lv, opts, command=f"pytest, machines_for({spec!r}).test_{lv}", patch=patch)
            except KvspecFailure as e:
                if not under_pytest():
                    raise
                text = e.text
            if text is not None:
                import pytest
                pytest.fail(text, pytrace=False)  # the finding, without kvspec's own frames
        test.__name__ = f"test_{lv}"
        test.__doc__ = f"kvspec's {lv}-level machine against {spec}: every invariant after every step."
        return test

    name = "Kvspec_" + (re.sub(r"[^A-Za-z0-9]+", "_", spec).strip("_") or "target")
    attrs = {f"test_{lv}": make(lv) for lv in levels}
    import sys
    caller = sys._getframe(1).f_globals.get("__name__", __name__)
    attrs.update(kvspec_target=tgt, kvspec_spec=spec, kvspec_levels=tuple(levels), __module__=caller)
    return type(name, (unittest.TestCase,), attrs)
