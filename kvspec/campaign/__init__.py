"""``kvspec campaign FILE.toml``: a matrix of ``kvspec check``, ``mc`` and ``patches``
jobs run as Ray tasks, on a local Ray instance or a cluster (``--address``).

One job per module step: ``matrix`` expands the TOML file into jobs with stable ids;
``runner`` runs one job as a ``kvspec`` process of its own with ``--json`` (``warm``: a
fork of a long-lived kvspec process per Ray worker, for jobs without an environment of
their own); ``store`` keeps one
JSON per finished job in the results directory (a rerun skips them); ``execute`` hands
the pending jobs to Ray (imported lazily: it takes seconds) with task retries for a
node that dies; ``progress`` is the stderr line; ``findings`` deduplicates findings by
invariant and minimal repro; ``report`` writes Markdown, JSON, JUnit and the
time-to-failure figure; ``patches`` merges per-patch jobs into ``kvspec patches``'
own report; ``command`` ties them together.

May import: errors, report, corpus (the patches report). Never imports the CLI, and
never the checkers: every job runs in its own ``kvspec`` process (``warm``'s server,
a process of its own, loads targets and runs each job as ``python -m kvspec``, runpy,
in a fork).
"""
