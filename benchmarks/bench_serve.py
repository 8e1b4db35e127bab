"""Drives `specdec serve` at several loads, speculation on vs off (JSON, markdown and a plot).

The benchmark lives in the package (`specdec.bench_serve`, whose docstring says what it does);
this script runs it, as `specdec bench --serve` does: `python benchmarks/bench_serve.py --help`.
"""

import sys

from specdec.bench_serve import main

if __name__ == "__main__":
    sys.exit(main())
