"""CPU kernels for the target's forward: a block of d + 1 rows at about the cost of one row.

On CPU the target's forward is mostly its linear layers, and torch's fp32 GEMM pays for every
extra row: a block of a few rows costs several one-row steps (docs/benchmarks.md, "Component
measurements"). The kernel
in ``kernels.c`` (built here with the system C compiler, cached per source and ISA) reads
each weight once for all rows of the block. Each linear layer's weight is repacked IN PLACE into
panels of output columns (``pack_weight``: a permutation of the same storage, no copy kept, so
memory does not grow); a weight shared with another module (tied input embeddings) or whose
output count is not a multiple of the panel width stays as it is and goes through the kernel's
dot-product form instead. ``CpuKernelPatch.remove()`` permutes every weight back, bitwise: the
transformers model stays the source of truth. See the C file for why each row's result is
bitwise independent of how many rows share the call, in both forms.

Two modes, applied to a loaded fp32 model on CPU by ``apply_cpu_kernels``:

- fast (default): every nn.Linear through the kernel; attention as transformers' eager one
  without its per-head copies of the KV cache (``attention.gqa_attention``).
- batch-invariant: the same linears, and attention one query row at a time against exactly the
  keys it sees (``attention.rowwise_attention``), so a row's logits do not depend on how many
  rows share the forward: greedy SPADE output equals target-only output by construction, not
  by observation. Without a C compiler it still holds, with each linear run row by row through
  torch (slow).

Both are undone by ``CpuKernelPatch.remove()``, which restores the stock modules.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeGuard

import torch
from torch import nn

from spade_models.attention import attention_implementation, set_attention_implementation
from verifier_service.backends.transformers.cpu.attention import GQA_ATTENTION, KERNEL_ATTRIBUTE, ROWWISE_ATTENTION, register_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("kernels.c")
ISA_FLAGS = {"AVX512": ("-mavx512f", "-mfma"), "AVX2": ("-mavx2", "-mfma")}
"""torch's CPU capability -> compiler flags; the C file picks its vector width from them."""
BUILD_FLAGS = ("-O3", "-Wall", "-Wextra", "-fPIC", "-shared")
"""Optimised, with warnings on (the source compiles clean: tests/test_cpu_kernels.py), a shared library."""
COMPILE_TIMEOUT_S = 120


@dataclass(frozen=True)
class KernelLibrary:
    """The compiled kernel, loaded."""

    library: ctypes.CDLL = field(repr=False)
    isa: str
    path: Path

    @property
    def panel_width(self) -> int:
        """Output columns per panel of a packed weight (two vectors)."""
        return int(self.library.spade_panel_width())

    def linear(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows [M, K] @ weight[N, K]^T + bias: fp32, contiguous, on CPU; weight row-major."""
        return self._call(self.library.spade_linear, rows, weight, bias)

    def packed_linear(self, rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The same product with the weight packed by ``pack_weight`` (N a multiple of the panel width)."""
        return self._call(self.library.spade_packed_linear, rows, packed_weight, bias)

    @staticmethod
    def _call(function, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        num_rows, num_inputs = rows.shape
        output = torch.empty(num_rows, weight.shape[0], dtype=torch.float32)
        function(
            rows.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            output.data_ptr(),
            num_rows,
            weight.shape[0],
            num_inputs,
            torch.get_num_threads(),
        )
        return output

    @property
    def attends(self) -> bool:
        """Whether this build has the batch-invariant attention (a bench's older source may not)."""
        return hasattr(self.library, "spade_rowwise_attention")

    def can_attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether ``rowwise_attention`` takes these: fp32 on CPU, one sequence, head_dim a
        multiple of the vector width and contiguous within a head, at most 64 query heads per KV head."""
        tensors = (query, key, value)
        head_dim, num_heads, num_kv_heads = query.shape[-1], query.shape[1], key.shape[1]
        return (
            self.attends
            and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.shape[0] == 1 and t.stride(-1) == 1 for t in tensors)
            and head_dim % int(self.library.spade_attention_lanes()) == 0
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= 64
        )

    def rowwise_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [1, heads, rows, head_dim] against key, value [1, kv_heads, keys, head_dim] whose
        last ``rows`` keys are the rows' own: each row alone against the keys up to its position
        (see the C file), as [1, rows, heads, head_dim]. ``can_attend`` must hold."""
        _, num_heads, num_rows, head_dim = query.shape
        num_kv_heads, num_keys = key.shape[1], key.shape[2]
        output = torch.empty(1, num_rows, num_heads, head_dim, dtype=torch.float32)
        pairs = [(tensor.stride(1), tensor.stride(2)) for tensor in (query, key, value, output)]
        strides = (ctypes.c_longlong * 8)(*(stride for pair in pairs for stride in pair))
        status = self.library.spade_rowwise_attention(
            query.data_ptr(),
            key.data_ptr(),
            value.data_ptr(),
            output.data_ptr(),
            num_rows,
            num_heads,
            num_kv_heads,
            head_dim,
            num_keys,
            strides,
            ctypes.c_float(scaling),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
        return output


def cpu_isa() -> str | None:
    """The vector ISA the kernel can be built for here (``AVX512``, ``AVX2``), else None."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in ISA_FLAGS else None


def runnable_isas() -> list[str]:
    """Every kernel ISA this machine runs, best first (an AVX-512 CPU also runs the AVX2 build)."""
    isa = cpu_isa()
    return [] if isa is None else list(ISA_FLAGS)[list(ISA_FLAGS).index(isa) :]


def load_kernel_library(cache_dir: Path, isa: str | None = None, source: Path = KERNEL_SOURCE) -> KernelLibrary | None:
    """Build (once per source, ISA and compiler) and load the kernel, for this machine's best ISA
    or ``isa`` (one of ``runnable_isas()``); None when this machine cannot (no AVX2/AVX-512, no C
    compiler), with the reason logged. ``source``: another version of the kernel, for a bench
    that compares two side by side."""
    built = build_library(source, cache_dir, isa)
    if built is None:
        return None
    library, isa, path = built
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    for function in (library.spade_linear, library.spade_packed_linear):
        function.argtypes = [pointer, pointer, pointer, pointer, integer, integer, integer, integer]
        function.restype = None
    library.spade_panel_width.restype = integer
    if hasattr(library, "spade_rowwise_attention"):
        library.spade_rowwise_attention.argtypes = (
            [pointer] * 4 + [integer] * 5 + [ctypes.POINTER(ctypes.c_longlong), ctypes.c_float, integer]
        )
        library.spade_rowwise_attention.restype = integer
        library.spade_attention_lanes.restype = integer
    return KernelLibrary(library, isa, path)


def build_library(source: Path, cache_dir: Path, isa: str | None = None) -> tuple[ctypes.CDLL, str, Path] | None:
    """Compile ``source`` (once per source, ISA and compiler, into ``cache_dir/kernels``) for this
    machine's best ISA or ``isa``, and load it: (library, ISA, its file); None, with the reason
    logged, where it cannot."""
    if isa is not None and isa not in runnable_isas():
        raise ValueError(f"this CPU cannot run the {isa} kernel (it runs {runnable_isas() or 'none'})")
    isa = isa or cpu_isa()
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if isa is None or compiler is None:
        logger.warning("CPU kernels unavailable: %s", "no AVX2/AVX-512" if isa is None else "no C compiler (gcc/cc)")
        return None
    name = f"{source.stem}-{isa.lower()}-{kernel_digest(compiler, isa, source)}.so"
    for directory in (cache_dir / "kernels", fallback_kernel_dir()):
        path = directory / name
        try:
            if not path.is_file() and not compile_kernel(compiler, ISA_FLAGS[isa], path, source):
                return None
            return ctypes.CDLL(str(path)), isa, path
        except OSError as error:  # an unwritable cache (then the fallback), a library that does not load
            logger.warning("CPU kernels: cannot build or load in %s: %s", directory, error)
    logger.warning("CPU kernels unavailable: neither %s nor %s is usable", cache_dir / "kernels", fallback_kernel_dir())
    return None


def fallback_kernel_dir() -> Path:
    """Where the kernel is built when the cache directory cannot be written (a read-only volume):
    a directory of this user's in the system's temp directory, built again after a reboot."""
    return Path(tempfile.gettempdir()) / f"spade-kernels-{os.getuid()}"


def kernel_digest(compiler: str, isa: str, source: Path = KERNEL_SOURCE) -> str:
    """Changes with the source, the ISA, the compiler's version and the build's flags."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    hasher = hashlib.sha256(source.read_bytes())
    hasher.update(f"\x00{isa}\x00{compiler}\x00{version}\x00{BUILD_FLAGS}".encode())
    return hasher.hexdigest()[:16]


def compile_command(compiler: str, isa_flags: tuple[str, ...], output: str, openmp: bool, source: Path = KERNEL_SOURCE) -> list[str]:
    openmp_flags = ["-fopenmp"] if openmp else []
    return [compiler, *openmp_flags, *BUILD_FLAGS, *isa_flags, "-o", output, str(source)]


def compile_kernel(compiler: str, isa_flags: tuple[str, ...], path: Path, source: Path = KERNEL_SOURCE) -> bool:
    """Compile into a sibling temp file, then rename (concurrent starts race safely). OpenMP
    only splits weight rows across --threads, so a compiler without it still builds a kernel."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".so")
    os.close(handle)
    try:
        for openmp in (True, False):
            try:
                command = compile_command(compiler, isa_flags, staging, openmp, source)
                result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as error:
                logger.warning("CPU kernels: %s failed: %s", compiler, error)
                return False
            if result.returncode == 0:
                if result.stderr.strip():  # a compiler this source has not met: say what it found
                    logger.warning("CPU kernels: %s warned:\n%s", compiler, result.stderr[-2000:])
                os.chmod(staging, 0o755)
                os.replace(staging, path)
                logger.info("CPU kernels built: %s", path)
                return True
        logger.warning("CPU kernels: compiling %s failed:\n%s", source.name, result.stderr[-2000:])
        return False
    finally:
        if os.path.exists(staging):
            os.unlink(staging)


# --- patching a model -------------------------------------------------------------------------


@dataclass
class CpuKernelPatch:
    """What ``apply_cpu_kernels`` changed on a model, and how to undo it."""

    model: PreTrainedModel = field(repr=False)
    mode: str
    """``fast`` or ``batch_invariant``."""
    linear_path: str
    """``kernel-avx512``, ``kernel-avx2``, ``torch`` (fast mode without the kernel: stock
    F.linear) or ``torch-rowwise`` (batch-invariant without the kernel)."""
    num_linears: int
    attention: str
    previous_attention: str = field(repr=False, default="eager")
    patched: list[nn.Linear] = field(repr=False, default_factory=list)
    packed: list[nn.Linear] = field(repr=False, default_factory=list)
    """The patched layers whose weight is packed in place (panels of ``panel_width`` columns)."""
    panel_width: int = 0
    attending: list[nn.Module] = field(repr=False, default_factory=list)
    """The attention modules that carry the kernel for the batch-invariant attention."""

    def describe(self) -> str:
        packed = f" ({len(self.packed)} with packed weights)" if self.packed else ""
        return f"{self.mode}: {self.num_linears} linear layers on {self.linear_path}{packed}, attention {self.attention}"

    def remove(self) -> None:
        """Restore every packed weight (bitwise), the stock forward of every patched module and
        the previous attention."""
        for module in self.packed:
            unpack_weight(module.weight, self.panel_width)
        self.packed.clear()
        for module in self.patched:
            del module.forward  # the instance attribute shadowed the class's forward
        self.patched.clear()
        for attention_module in self.attending:
            delattr(attention_module, KERNEL_ATTRIBUTE)
        self.attending.clear()
        set_attention_implementation(self.model, self.previous_attention)


def apply_cpu_kernels(
    model: PreTrainedModel, library: KernelLibrary | None, batch_invariant: bool, pack_weights: bool = True
) -> CpuKernelPatch:
    """Route the model's linears through the kernel and switch its attention, in place.
    ``pack_weights=False`` keeps every weight row-major (the dot-product form only: what
    forward_bench compares the packed form against)."""
    if next(model.parameters()).device.type != "cpu" or model.dtype != torch.float32:
        raise ValueError("the CPU kernels take a float32 model on the CPU")
    register_attention()
    previous = attention_implementation(model)
    attention = ROWWISE_ATTENTION if batch_invariant else GQA_ATTENTION
    linears = [module for module in model.modules() if is_patchable(module)]
    packed: list[nn.Linear] = []
    if library is not None:
        linear_path, panel_width = f"kernel-{library.isa.lower()}", library.panel_width
        shared = shared_parameters(model)
        packed = [module for module in linears if pack_weights and can_pack(module, panel_width, shared)]
        unpacked_forward = kernel_forward(library.linear)
        packed_forward = kernel_forward(library.packed_linear, partial(unpacked, panel_width=panel_width))
    elif batch_invariant:  # nothing is packed without the kernel
        linear_path, panel_width, unpacked_forward, packed_forward = "torch-rowwise", 0, rowwise_forward, rowwise_forward
    else:
        linear_path, panel_width, unpacked_forward, packed_forward, linears = "torch", 0, None, None, []
    prefault_for_writing([module.weight for module in packed])
    for module in packed:
        pack_weight(module.weight, panel_width)
    packed_ids = {id(module) for module in packed}
    for module in linears:
        forward = packed_forward if id(module) in packed_ids else unpacked_forward
        # An instance attribute shadowing the class's forward (CpuKernelPatch.remove deletes it).
        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    attending = attention_modules(model) if batch_invariant and library is not None and library.attends else []
    for attention_module in attending:
        setattr(attention_module, KERNEL_ATTRIBUTE, library)
    set_attention_implementation(model, attention)
    mode = "batch_invariant" if batch_invariant else "fast"
    shown = f"{attention} (kernel-{library.isa.lower()})" if attending and library is not None else attention
    return CpuKernelPatch(model, mode, linear_path, len(linears), shown, previous, linears, packed, panel_width, attending)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules transformers hands to an attention implementation (Qwen2Attention,
    LlamaAttention, ...): the ones with a query projection."""
    return [module for module in model.modules() if isinstance(getattr(module, "q_proj", None), nn.Module)]


def is_patchable(module: nn.Module) -> TypeGuard[nn.Linear]:
    return (
        type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.is_contiguous()
        and (module.bias is None or module.bias.is_contiguous())
    )


def shared_parameters(model: nn.Module) -> set[int]:
    """ids of parameters that more than one module holds (tied input and output embeddings)."""
    counts = Counter(id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False))
    return {key for key, count in counts.items() if count > 1}


def can_pack(module: nn.Linear, panel_width: int, shared: set[int]) -> bool:
    """Packing permutes the weight's storage: only a weight this layer alone reads, with whole panels."""
    return module.weight.shape[0] % panel_width == 0 and id(module.weight) not in shared


MADV_POPULATE_WRITE = 23
"""Linux 5.14+ (include/uapi/asm-generic/mman-common.h): fault a range in, writable, in one call."""


def prefault_for_writing(tensors: list[torch.Tensor]) -> int:
    """Make the tensors' pages present and private in one madvise(MADV_POPULATE_WRITE) call each,
    contents unchanged, before the packing writes them. A memory-mapped checkpoint (safetensors)
    would otherwise take one copy-on-write fault per 4 KiB page as it is written, ~1.5 million for
    the 1.5B target: packing took 13.7-33.3 s that way against 10.8-11.4 s prefaulted, side by
    side (docs/runs/2026-12-03-forward-per-draft-length.md). Returns how many tensors were prefaulted: none off Linux or on a
    kernel without it (the packing is then only slower)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    page = mmap.PAGESIZE
    done = 0
    for tensor in tensors:
        start = tensor.data_ptr() // page * page  # the first page may hold another tensor too: unchanged all the same
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        if tensor.numel() and libc.madvise(start, end - start, MADV_POPULATE_WRITE) == 0:
            done += 1
    return done


PACK_CHUNK_BYTES = 1 << 20
"""Weights are permuted a few panels (about this many bytes) at a time: the temporary copy stays
in cache (six times faster than permuting a whole matrix at once; docs/runs/2026-12-03-forward-per-draft-length.md)."""


def pack_weight(weight: torch.Tensor, panel_width: int) -> None:
    """In place: row-major [N, K] becomes panels [N / P][K][P] (P = ``panel_width``) in the same
    storage; the tensor keeps its [N, K] shape. Panel p's rows are its own storage before and
    after, so panels are permuted one chunk at a time. Undone by ``unpack_weight``."""
    with torch.no_grad():
        for chunk in _panel_chunks(weight, panel_width):
            num_panels, num_inputs = chunk.shape[0] // panel_width, chunk.shape[1]
            panels = chunk.view(num_panels, panel_width, num_inputs).transpose(1, 2).contiguous()
            chunk.view(-1).copy_(panels.view(-1))


def unpack_weight(weight: torch.Tensor, panel_width: int) -> None:
    """In place: the inverse of ``pack_weight`` (a permutation: bitwise the original)."""
    with torch.no_grad():
        for chunk in _panel_chunks(weight, panel_width):
            chunk.view(-1).copy_(unpacked(chunk, panel_width).contiguous().view(-1))


def _panel_chunks(weight: torch.Tensor, panel_width: int) -> list[torch.Tensor]:
    """Views of consecutive whole panels' rows, about PACK_CHUNK_BYTES each."""
    row_bytes = weight.shape[1] * weight.element_size()
    rows = max(1, PACK_CHUNK_BYTES // (row_bytes * panel_width)) * panel_width
    return list(weight.split(rows))


def unpacked(weight: torch.Tensor, panel_width: int) -> torch.Tensor:
    """A row-major copy of a packed weight (or of whole packed panels)."""
    num_outputs, num_inputs = weight.shape
    return weight.view(num_outputs // panel_width, num_inputs, panel_width).transpose(1, 2).reshape(num_outputs, num_inputs)


def kernel_forward(product: Callable[..., torch.Tensor], row_major: Callable[[torch.Tensor], torch.Tensor] = lambda weight: weight):
    """A linear layer's forward through ``product`` (``KernelLibrary.linear``, or ``packed_linear``
    with ``row_major`` undoing the packing); anything the kernel does not take (another dtype or
    device, autograd) gets stock F.linear on the row-major weight."""

    def forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
        if input.dtype != torch.float32 or input.device.type != "cpu" or (input.requires_grad and torch.is_grad_enabled()):
            return nn.functional.linear(input, row_major(module.weight), module.bias)
        rows = input.reshape(-1, input.shape[-1]).contiguous()
        return product(rows, module.weight, module.bias).view(*input.shape[:-1], module.weight.shape[0])

    return forward


def rowwise_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """One F.linear call per row, each on a fresh (equally aligned) one-row tensor: the exact
    computation of a one-token step, whatever the block size."""
    rows = input.reshape(-1, input.shape[-1])
    outputs = [nn.functional.linear(row.clone(), module.weight, module.bias) for row in rows.split(1)]
    output = torch.cat(outputs) if outputs else rows.new_empty(0, module.weight.shape[0])
    return output.view(*input.shape[:-1], module.weight.shape[0])


BatchInvariance = Literal["required", "preferred", "off"]
"""How the batch-invariant mode is asked for: ``required`` (asked for: an error where it cannot
be met), ``preferred`` (the default: where the compiled kernel makes it cheap, i.e. CPU, float32
and a C compiler; the fast mode elsewhere), ``off``."""


def prepare_cpu_kernels(
    model: PreTrainedModel,
    fast_kernels: bool,
    batch_invariant: bool | BatchInvariance,
    cache_dir: str | Path | None = None,
    isa: str | None = None,
) -> CpuKernelPatch | None:
    """What the transformers backend calls on its freshly loaded model: the kernels where they
    apply (CPU, float32), stock transformers elsewhere. A ``required`` batch invariance cannot be
    met elsewhere, so it raises instead; a ``preferred`` one needs the compiled kernel too (the
    batch-invariant mode without it runs each linear row by row: slow), else the fast mode runs.
    ``isa``: the kernel's ISA (one of ``runnable_isas()``; None: the best); another raises."""
    invariance = as_invariance(batch_invariant)
    if not fast_kernels and invariance != "required":
        return None
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        if invariance == "required":
            raise ValueError("--batch-invariant needs --device cpu and --dtype float32")
        logger.info("CPU kernels not applied: the model is %s on %s", parameter.dtype, parameter.device)
        return None
    from spade_models.pull import resolve_cache_dir

    library = load_kernel_library(resolve_cache_dir(cache_dir), isa)
    started = time.perf_counter()
    patch = apply_cpu_kernels(model, library, invariance == "required" or (invariance == "preferred" and library is not None))
    logger.info("CPU kernels: %s (applied in %.1f s)", patch.describe(), time.perf_counter() - started)
    return patch


def as_invariance(batch_invariant: bool | BatchInvariance) -> BatchInvariance:
    """A plain bool is asked for explicitly: True ``required``, False ``off``."""
    if batch_invariant is True:
        return "required"
    if batch_invariant is False:
        return "off"
    return batch_invariant
