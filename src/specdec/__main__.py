"""`python -m specdec ...`: the `specdec` command without an installed entry point."""

import sys

from specdec.cli import main

sys.exit(main())
