"""`python -m specdec.cli`."""

import sys

from specdec.cli import main

sys.exit(main())
