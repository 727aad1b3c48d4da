"""Load a causal LM and its tokenizer from a model source, the same way for both services."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from."""

    model: str
    """A Hugging Face id, a local directory, or a path to a .gguf file."""
    gguf_file: str | None = None
    """The GGUF file inside ``model`` (a directory or hub repo) to load and dequantize."""

    @property
    def model_id(self) -> str:
        """The id users pass as ``model``: the directory or file name, or the hub id."""
        path = Path(self.model)
        if self.gguf_file:
            return Path(self.gguf_file).stem
        if path.suffix == ".gguf":
            return path.stem
        return path.name if path.exists() else self.model


@dataclass
class LoadedModel:
    model: PreTrainedModel = field(repr=False)
    tokenizer: object = field(repr=False)
    model_id: str
    device: str
    dtype: str
    load_seconds: float
    num_parameters: int


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(set(DTYPES))}") from None


def load_model(source: ModelSource, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load model + tokenizer in eval mode on ``device`` with ``dtype``."""
    started = time.perf_counter()
    directory, gguf_file = _split_gguf(source)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=parse_dtype(dtype), attn_implementation="eager", **kwargs
    )
    model = model.to(device).eval()
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=source.model_id,
        device=device,
        dtype=str(model.dtype).removeprefix("torch."),
        load_seconds=time.perf_counter() - started,
        num_parameters=sum(parameter.numel() for parameter in model.parameters()),
    )
    logger.info(
        "loaded %s (%.1f M parameters, %s on %s) in %.1f s",
        loaded.model_id, loaded.num_parameters / 1e6, loaded.dtype, device, loaded.load_seconds,
    )
    return loaded


def _split_gguf(source: ModelSource) -> tuple[str, str | None]:
    path = Path(source.model)
    if source.gguf_file is None and path.suffix == ".gguf":
        return str(path.parent), path.name
    return source.model, source.gguf_file


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of the token table and special tokens: equal iff two tokenizers map text to the
    same ids (the edge refuses a verifier whose fingerprint differs from its draft's)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    hasher = hashlib.sha256()
    for token, token_id in vocab:
        hasher.update(f"{token_id}\x00{token}\x01".encode())
    hasher.update(repr(sorted(tokenizer.all_special_tokens)).encode())
    return hasher.hexdigest()[:32]


def eos_token_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the generation config's (often a list) and the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
