"""Rendering results: one-screen ``text``, report ``files`` (Markdown, JSON, JUnit) and
``figures``.

May import: spec, targets, errors, and ``kvspec.check.session`` (to replay a finding
for its before/after block tables). Never imports the CLI.
"""
