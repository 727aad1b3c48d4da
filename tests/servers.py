"""Real uvicorn servers on loopback ports for tests (``spade_bench.loopback``, which the chaos run
uses too)."""

from spade_bench.loopback import LoopbackServer, serve, wait_until

__all__ = ["LoopbackServer", "serve", "wait_until"]
