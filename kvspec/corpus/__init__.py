"""The bundled bug corpora (``<target>/bugs.json`` and the diffs, package data) and
``kvspec patches``: running trials in worker processes (``runner``), statistics
(``stats``), the reports (``report``) and the ``command``.

May import: spec, targets, check, mc, report, errors, patching.
"""
