"""The executable spec: the op vocabulary (``ops``), the one normalized ``observation``,
the run ``config``, the reference models (``model``), the invariant catalogue
(``invariants``, with the incremental ``fast_check``), ``violation`` and the shadow
stores (``shadow``).

May import: nothing from kvspec but ``kvspec.errors``. Targets, checkers and reports
depend on the spec, never the other way round.
"""
