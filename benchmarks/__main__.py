"""`python -m benchmarks --backend jax`: the same as `python benchmarks/run.py`."""

import sys

from benchmarks.run import main

sys.exit(main())
