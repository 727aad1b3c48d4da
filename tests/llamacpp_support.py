"""llama.cpp's own decoding, the reference the llama.cpp drafter's tests compare with."""

from __future__ import annotations

import numpy as np


class Reference:
    """llama.cpp's own decoding in a fresh context per call, straight through the binding."""

    def __init__(self, draft) -> None:
        import cyllama.llama.llama_cpp as llama_cpp

        self._llama_cpp = llama_cpp
        self._model = draft.model

    def logits_after(self, token_ids: list[int]) -> np.ndarray:
        context = self._context()
        self._decode(context, token_ids, 0)
        return np.array(context.get_logits_ith(-1), dtype=np.float32)

    def greedy(self, token_ids: list[int], num_tokens: int) -> list[int]:
        context = self._context()
        self._decode(context, token_ids, 0)
        drafted = []
        for _ in range(num_tokens):
            drafted.append(int(np.argmax(np.array(context.get_logits_ith(-1), dtype=np.float32))))
            self._decode(context, drafted[-1:], len(token_ids) + len(drafted) - 1)
        return drafted

    def _context(self):
        params = self._llama_cpp.LlamaContextParams()
        params.n_ctx, params.n_threads, params.n_threads_batch = 512, 1, 1
        return self._llama_cpp.LlamaContext(self._model, params)

    def _decode(self, context, token_ids: list[int], first_position: int) -> None:
        batch = self._llama_cpp.LlamaBatch(n_tokens=len(token_ids), embd=0, n_seq_max=1)
        for offset, token_id in enumerate(token_ids):
            batch.add(token_id, first_position + offset, [0], offset == len(token_ids) - 1)
        context.decode(batch)
