"""`python -m worker`: the engine worker (worker/cli.py)."""

import sys

from worker.cli import main

sys.exit(main())
