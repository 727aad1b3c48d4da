"""``python -m spade_bench.gpu_check``: the check (``scripts/gpu_check``)."""

import sys

from spade_bench.gpu_check.run import main

sys.exit(main())
