"""The transformers backend's CPU fast path: the linear layers' kernel on weights packed in place
(``kernels``, ``kernels.c``) and the attention kernels (``attention``), for float32 on a CPU."""
