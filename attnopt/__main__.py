"""``python -m attnopt``: the ``attnopt`` command line."""
from attnopt.cli import main

raise SystemExit(main())
