"""The vLLM backend: vLLM's engine in-process (``backend``), its requests for verify calls
(``requests``), the native target-only route (``native``) and edge proposals delivered into vLLM's
engine process for its proposer hook (``proposals``). Imported only with ``--backend vllm``."""
