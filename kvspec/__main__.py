"""``python -m kvspec``: the same command line as the ``kvspec`` script."""
from kvspec.cli import main

raise SystemExit(main())
