"""``python -m spade_bench.capacity``: the capacity replay (``spade_bench.capacity.replay``)."""

import sys

from spade_bench.capacity.replay import main

sys.exit(main())
