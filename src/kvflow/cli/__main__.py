"""``python -m kvflow.cli``."""

from kvflow.cli.main import main

raise SystemExit(main())
