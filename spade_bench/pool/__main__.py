"""``python -m spade_bench.pool``: the pool benchmark (``spade_bench.pool.bench``)."""

from spade_bench.pool.bench import main

main()
