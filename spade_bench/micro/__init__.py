"""Micro-benchmarks, each ``python -m spade_bench.micro.<name>``, each answering one question:

- ``forward_bench``: does a block of drafted tokens cost about one token? The target's forward per
  draft length, per kernel ISA and mode, beside the core's physics (``cpu_physics``: the measured
  stream bandwidth and in-register FMA rate).
- ``rows_bench``: the verifier's ragged forward per row count and session count (the cost curve
  the verifier's advice fits).
- ``backend_bench``: the verifier backends against each other per verify call.
- ``batched_decode_bench``: llama.cpp, one decode over K draft sequences against K decodes.
- ``prefix_bench``: the prefix cache's time to first token (a shared system prompt, a second turn).
- ``target_routes``: vLLM's two target-only routes side by side.
- ``vllm_session_probe``: vLLM's proposer hook fed from another process while requests run.
"""
