"""Checking a target against the spec: the ``session`` (one step: target, reference
model, observation, every invariant), the Hypothesis ``search`` behind ``kvspec
check``, the minimizer (``minimize``: ddmin, then a bounded BFS that proves the length
minimal), standalone ``repro`` files and their ``replay``, ``crosshair`` (``kvspec
diff``) and the check ``command``; the per-call ``watchdog`` (``--op-timeout``, NO_HANG),
``jobs`` (``--jobs N`` workers) and the pytest plugin's Hypothesis ``profiles``.

May import: spec, targets, errors, patching, ``kvspec.stateful``, ``kvspec.report``
(rendering only), and ``kvspec.mc`` (the minimizer's proof, imported where it is used).
"""
