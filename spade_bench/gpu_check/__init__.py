"""The prepared check for a lent GPU machine (no network, a 64 MiB upload, torch + transformers):
the target's forward cost per row count and a short capacity run, transformers backend on CUDA.

Timings do not depend on the weights, so the model is built there: Qwen2.5-1.5B's shape (hidden
1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocabulary 151,936) with random
weights, the output layer scaled so that greedy choices are clear of near-ties (as
``spade_models.tiny`` does), and a word-level tokenizer of one word per id (made with the
``tokenizers`` library; any generated id decodes).

    forward    one sequence over a cached context, r rows fed at once (r = 1 .. 512): the
               linear layers' M is r, as in a batch of sessions whose rows sum to r; wall time
               to a synchronised result, medians; in float32 and bfloat16. Where the time
               starts to grow is the knee.
    ragged     the verifier's own forward (``rows_bench``): R rows shared by S sessions, each
               after its own cached context; what S sessions cost beyond R rows is the
               per-session work (attention and its launches), one attention call per
               session (fast) and one for all (packed).
    capacity   synthetic sessions: random prompts, the target's own greedy output (the
               verifier's, one empty-block call per token), and draft proposals that equal the
               target's token with probability --acceptance (else another token); then N
               emulated edges (``emulated_edge``, advice, and advice with continuation; and on
               the pipelined-session wire, ``pipelined_edge``: --modes) and N target-only users
               against one verifier, and the prefill-interference scenario
               (``capacity.levels``, ``capacity.prefill_interference``).

The verifier is this project's own engine (the transformers backend), not vLLM's, unless
``--backend vllm``: then the script first checks that vLLM imports (and stops, saying so, where it
does not: the lent machines have no vLLM), and runs the capacity part only, target-only on vLLM's
native decoding and ``spade+pipe`` on its session route (one vLLM request per edge session).

Everything is written under --output (markdown + JSON). On the GPU machine:

    scripts/gpu_check --output $OUT                      # about 5 minutes on an H200
    scripts/gpu_check --backend vllm --output $OUT       # where vLLM is installed
    scripts/gpu_check --device cpu --tiny --output /tmp/g   # the same steps, tiny, on a CPU

The package: ``config`` (the shapes, what a run measures, its command line), ``model`` (the random
model, its forward's cost, the synthetic sessions), ``run`` (the services, the run, its report);
``python -m spade_bench.gpu_check`` is ``scripts/gpu_check``.
"""

from __future__ import annotations

from spade_bench.gpu_check.config import HOST_BOUND_SHAPE, PARTS, QWEN_SHAPE, SHAPES, TINY_SHAPE, CheckConfig, parse_args
from spade_bench.gpu_check.model import build_model, build_tokenizer, synthetic_proposals
from spade_bench.gpu_check.run import main, run_check, verifier_spec

__all__ = [
    "HOST_BOUND_SHAPE",
    "PARTS",
    "QWEN_SHAPE",
    "SHAPES",
    "TINY_SHAPE",
    "CheckConfig",
    "build_model",
    "build_tokenizer",
    "main",
    "parse_args",
    "run_check",
    "synthetic_proposals",
    "verifier_spec",
]
