"""Load a causal LM and its tokenizer from a model source, the same way for both services.

A source is a registry name (``qwen2.5-coder-1.5b-instruct``, pulled into the cache), a GGUF
file, a directory or hub repo with a GGUF file in it, or an ordinary transformers checkpoint.

GGUF files are dequantized by transformers, which takes most of a minute for the 1.5B on two
cores. So the first load of a GGUF saves the dequantized model (safetensors, in the requested
dtype) and its tokenizer under ``<cache>/converted/<key>-<dtype>/``, and later loads read that
directory instead. The key is the pinned sha256 for a registry name, and file name + size +
mtime for any other GGUF file (hashing a gigabyte at every start would cost seconds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from spade_models.pull import pull, resolve_cache_dir
from spade_models.registry import get_registered, is_registered

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

CONVERTED_MARKER = "spade_converted.json"
"""Written last into a converted directory: its presence means the directory is complete."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from."""

    model: str
    """A registry name (see ``spade-models list``), a Hugging Face id, a local directory, or a
    path to a .gguf file."""
    gguf_file: str | None = None
    """The GGUF file inside ``model`` (a directory or hub repo) to load and dequantize."""
    cache_dir: str | None = None
    """Pulled and converted models live here; None means ``$SPADE_CACHE_DIR`` or ~/.cache/spade."""

    @property
    def is_registered(self) -> bool:
        """A registry name (an existing local path of the same name wins)."""
        return self.gguf_file is None and is_registered(self.model) and not Path(self.model).exists()

    @property
    def is_gguf(self) -> bool:
        """A GGUF file (registry name, .gguf path or ``gguf_file``), known without fetching it."""
        return self.is_registered or self.gguf_file is not None or Path(self.model).suffix == ".gguf"

    @property
    def model_id(self) -> str:
        """The id users pass as ``model``: the registry name, the directory or file name, or the hub id."""
        path = Path(self.model)
        if self.is_registered:
            return self.model
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
    loaded_from: str = ""
    """The directory or file the weights were read from (a converted cache directory, when one was used)."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return eos_token_ids(self.tokenizer, self.model.generation_config, self.model.config)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(set(DTYPES))}") from None


def dtype_name(name: str) -> str:
    """Canonical spelling: "fp32" -> "float32"."""
    return str(parse_dtype(name)).removeprefix("torch.")


def load_model(source: ModelSource, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load model + tokenizer in eval mode on ``device`` with ``dtype``."""
    started = time.perf_counter()
    model, tokenizer, loaded_from = _load_weights(source, dtype_name(dtype))
    # transformers wraps PreTrainedModel.to in functools.wraps, whose stub loses the bound self.
    model = model.to(device).eval()  # type: ignore[arg-type]
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=source.model_id,
        device=device,
        dtype=str(model.dtype).removeprefix("torch."),
        load_seconds=time.perf_counter() - started,
        num_parameters=sum(parameter.numel() for parameter in model.parameters()),
        loaded_from=loaded_from,
    )
    _log_loaded(loaded)
    return loaded


def _load_weights(source: ModelSource, dtype: str) -> tuple[PreTrainedModel, object, str]:
    gguf = _resolve_gguf(source)
    if gguf is None:
        return (*_from_pretrained(source.model, None, dtype), source.model)
    converted = converted_dir(resolve_cache_dir(source.cache_dir), gguf.key, dtype)
    if is_converted(converted):
        logger.info("loading %s from the converted cache %s", source.model_id, converted)
        return (*_from_pretrained(str(converted), None, dtype), str(converted))
    path = gguf.path()
    logger.info("dequantizing %s to %s (first load; later loads use %s)", path, dtype, converted)
    model, tokenizer = _from_pretrained(str(path.parent), path.name, dtype)
    save_converted(model, tokenizer, converted, {"source": source.model, "gguf": str(path), "dtype": dtype})
    return model, tokenizer, str(path)


def _from_pretrained(directory: str, gguf_file: str | None, dtype: str) -> tuple[PreTrainedModel, object]:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=parse_dtype(dtype), attn_implementation="eager", **kwargs, **_dequantize_kwargs(gguf_file)
    )
    return model, tokenizer


def _dequantize_kwargs(gguf_file: str | None) -> dict:
    """Ask for plain dense weights in the requested dtype.

    Newer transformers can keep GGUF blocks packed (with the ``kernels`` package); such a model
    computes differently from the dense one and cannot be saved, so we always dequantize.
    Older versions have no ``GgufConfig`` and always dequantize."""
    if gguf_file is None:
        return {}
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


# --- which GGUF, under which cache key --------------------------------------------------------


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file to dequantize, named by a cache key that changes whenever its bytes do."""

    key: str
    local_path: Path | None = None
    registry_name: str | None = None
    cache_dir: str | None = None

    def path(self) -> Path:
        """The file on disk; a registry model is pulled here (only when no converted copy exists)."""
        if self.local_path is not None:
            return self.local_path
        if self.registry_name is None:
            raise ValueError(f"GGUF source {self.key} has neither a local path nor a registry name")
        return pull(self.registry_name, self.cache_dir)


def _resolve_gguf(source: ModelSource) -> GgufSource | None:
    if source.is_registered:
        model = get_registered(source.model)
        return GgufSource(f"{model.name}-{model.sha256[:16]}", registry_name=model.name, cache_dir=source.cache_dir)
    path = _local_gguf_path(source)
    return None if path is None else GgufSource(file_cache_key(path), local_path=path)


def _local_gguf_path(source: ModelSource) -> Path | None:
    path = Path(source.model).expanduser()
    if source.gguf_file is None:
        return path if path.suffix == ".gguf" else None
    if path.is_dir():
        return path / source.gguf_file
    from huggingface_hub import hf_hub_download  # a hub repo: the hub's own cache holds the file

    return Path(hf_hub_download(source.model, source.gguf_file))


def file_cache_key(path: Path) -> str:
    """``<stem>-<digest of name, size, mtime>``: a new key whenever the file is replaced."""
    try:
        stat = path.stat()
    except OSError as error:
        raise ValueError(f"GGUF file {path} not readable: {error}") from error
    digest = hashlib.sha256(f"{path.name}\x00{stat.st_size}\x00{stat.st_mtime_ns}".encode()).hexdigest()
    return f"{path.stem}-{digest[:16]}"


# --- the converted cache ----------------------------------------------------------------------


def converted_dir(cache_dir: Path, key: str, dtype: str) -> Path:
    return cache_dir / "converted" / f"{key}-{dtype_name(dtype)}"


def is_converted(directory: Path) -> bool:
    return (directory / CONVERTED_MARKER).is_file()


def save_converted(model: PreTrainedModel, tokenizer, directory: Path, info: dict) -> None:
    """Save model + tokenizer into ``directory`` atomically (build a sibling, then rename).

    A failure to save (a full disk, say) is logged and costs only the next start's speed."""
    _save_atomically(directory, info, "the converted model", model.save_pretrained, tokenizer.save_pretrained)


def _save_atomically(directory: Path, info: dict, what: str, *savers: Callable[[Path], object]) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    if directory.exists() and not is_converted(directory):
        shutil.rmtree(directory, ignore_errors=True)  # left by an interrupted run
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}-"))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a shared cache volume needs it readable
        for save in savers:
            save(staging)
        (staging / CONVERTED_MARKER).write_text(json.dumps({**info, "saved_at": time.time()}, indent=1))
        os.replace(staging, directory)
        logger.info("saved %s to %s", what, directory)
    except OSError as error:
        if is_converted(directory):
            logger.info("another process saved %s first", directory)
        else:
            logger.warning("could not save %s to %s: %s", what, directory, error)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --- the GGUF file and tokenizer alone (runtimes that read GGUF themselves: llama.cpp) -------


def gguf_file_path(source: ModelSource) -> Path:
    """The GGUF file of a GGUF source on disk; a registry model is pulled first."""
    gguf = _resolve_gguf(source)
    if gguf is None:
        raise ValueError(f"{source.model!r} is not a registry name or GGUF file")
    return gguf.path()


def tokenizer_dir(cache_dir: Path, key: str) -> Path:
    return cache_dir / "converted" / f"{key}-tokenizer"


def load_tokenizer(source: ModelSource):
    """The tokenizer alone, without the weights.

    Reading it out of a GGUF file takes tens of seconds (gguf-py parses the token table in
    Python; docs/benchmarks.md, "Component measurements"), so it is read from
    a converted directory of the same file when there is one (any dtype: the tokenizer is the
    same), else from the file once and saved alone under ``<cache>/converted/<key>-tokenizer/``."""
    gguf = _resolve_gguf(source)
    if gguf is None:
        return AutoTokenizer.from_pretrained(source.model)
    cache_dir = resolve_cache_dir(source.cache_dir)
    saved = [tokenizer_dir(cache_dir, gguf.key), *sorted((cache_dir / "converted").glob(f"{gguf.key}-*"))]
    for directory in saved:
        if is_converted(directory):
            return AutoTokenizer.from_pretrained(str(directory))
    path = gguf.path()
    logger.info("reading the tokenizer of %s (first time; later starts read %s)", path, tokenizer_dir(cache_dir, gguf.key))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    info = {"source": source.model, "gguf": str(path), "tokenizer_only": True}
    _save_atomically(tokenizer_dir(cache_dir, gguf.key), info, "the tokenizer", tokenizer.save_pretrained)
    return tokenizer


def convert(source: ModelSource, dtype: str = "float32") -> Path:
    """Build the converted cache of a GGUF source (no-op when present); return its directory."""
    gguf = _resolve_gguf(source)
    if gguf is None:
        raise ValueError(f"{source.model!r} is not a registry name or GGUF file; nothing to convert")
    directory = converted_dir(resolve_cache_dir(source.cache_dir), gguf.key, dtype)
    if not is_converted(directory):
        load_model(source, device="cpu", dtype=dtype)
    if not is_converted(directory):
        raise RuntimeError(f"could not save the converted model to {directory} (see the log above)")
    return directory


# --- reporting --------------------------------------------------------------------------------


def memory_report(device: str) -> str:
    """Resident memory now and at peak, plus CUDA memory when on a GPU."""
    parts = [f"RSS {_rss_bytes() / 2**30:.2f} GiB (peak {_peak_rss_bytes() / 2**30:.2f} GiB)"]
    if device.startswith("cuda") and torch.cuda.is_available():
        parts.append(
            f"CUDA allocated {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB "
            f"(peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB)"
        )
    return ", ".join(parts)


def _rss_bytes() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return _peak_rss_bytes()
    return pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    try:
        import resource
    except ImportError:  # not POSIX
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _log_loaded(loaded: LoadedModel) -> None:
    logger.info(
        "loaded %s (%.1f M parameters, %s on %s) from %s in %.1f s; %s",
        loaded.model_id,
        loaded.num_parameters / 1e6,
        loaded.dtype,
        loaded.device,
        loaded.loaded_from,
        loaded.load_seconds,
        memory_report(loaded.device),
    )


# --- tokenizer facts both services agree on ---------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of the token table and special tokens: equal iff two tokenizers map text to the
    same ids (the edge refuses a verifier whose fingerprint differs from its draft's)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    hasher = hashlib.sha256()
    for token, token_id in vocab:
        hasher.update(f"{token_id}\x00{token}\x01".encode())
    hasher.update(repr(sorted(tokenizer.all_special_tokens)).encode())
    return hasher.hexdigest()[:32]


def eos_token_ids(tokenizer: Any, *configs: Any) -> frozenset[int]:
    """Every id that ends generation, for both backends: each config's ``eos_token_id`` (the
    generation config's is often a list; a config may be an object or a mapping) and the
    tokenizer's. transformers passes the model's generation config and config, vLLM its own
    readings of the same two files."""
    ids: set[int] = set()
    for config in configs:
        configured = config.get("eos_token_id") if isinstance(config, Mapping) else getattr(config, "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif configured:
            ids.update(configured)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
