"""The verifier's CPU kernels (verifier_service/backends/transformers/cpu/kernels.py and .c).

The kernel, for every ISA the CPU runs (an AVX-512 box builds and tests the AVX2 variant too),
in both forms (row-major weights and weights packed in panels): every output equals a float64
reference within fp32 rounding, whatever the shape (tails of K, edges of N, 1 to 40 rows); a
row's output is bitwise the same whether it is computed alone or among other rows, and whatever
the thread count.

The model: through the whole tiny target, the batch-invariant mode gives each row of an M-row
block (M = 2..16) bitwise the logits a one-token forward at its position gives, with the kernel
and with its torch fallback; the fast mode stays within fp32 rounding of stock transformers and
keeps its greedy choices; removing the patch restores stock transformers exactly.

The service: verify answers report the model's own time, /metrics counts forwards per block
length, and greedy SPADE output equals target-only output with the verifier in the
batch-invariant mode.
"""

from __future__ import annotations

import os
import platform
import random
import re
import shutil
import subprocess
import sys

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import DynamicCache

from edge_support import edge_app
from edge_support import verifier_app as full_context_verifier_app
from greedy_support import TINY_PAIR_CASES, generate
from servers import serve
from spade_models.attention import attention_implementation
from spade_models.kv_cache import cache_argument_name
from spade_models.loader import ModelSource, load_model
from verifier_service.backends.transformers.cpu import kernels as cpu_kernels
from verifier_service.backends.transformers.cpu.attention import KERNEL_ATTRIBUTE, rowwise_attention
from verifier_service.backends.transformers.cpu.kernels import (
    COMPILE_TIMEOUT_S,
    ISA_FLAGS,
    KERNEL_SOURCE,
    apply_cpu_kernels,
    can_pack,
    compile_command,
    load_kernel_library,
    pack_weight,
    prefault_for_writing,
    prepare_cpu_kernels,
    runnable_isas,
    shared_parameters,
)
from verifier_service.backends.transformers.growing_cache import GROWTH_TOKENS, growing_cache
from verifier_service.metrics import block_label
from verifier_support import (
    greedy_block,
    new_session_id,
    random_tokens,
    reference_verdict,
    running_verifier,
    verdict,
    verify,
    verify_body,
)


@pytest.fixture(scope="module", params=runnable_isas() or [None])
def library(request, tmp_path_factory):
    """The kernel for every ISA this CPU runs (an AVX-512 box also tests the AVX2 build)."""
    built = None if request.param is None else load_kernel_library(tmp_path_factory.mktemp("kernel-cache"), request.param)
    if built is None:
        pytest.skip("the CPU kernel cannot be built here (needs AVX2 or AVX-512 and gcc/cc); see the warning logged")
    assert built.isa == request.param
    return built


@pytest.fixture
def model(tiny_pair):
    """A fresh copy of the tiny target per test: patching changes the model in place."""
    return load_model(ModelSource(str(tiny_pair.target_dir))).model


FORMS = ["dot", "packed"]
"""The kernel's two forms: on the row-major weight, and on the weight packed in panels."""


def kernel_linear(library, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int = 1, form: str = "dot"):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if form == "dot":
            return library.linear(rows, weight, bias)
        packed = weight.clone()
        pack_weight(packed, library.panel_width)
        return library.packed_linear(rows, packed, bias)
    finally:
        torch.set_num_threads(previous)


def output_count(library, form: str, num_outputs: int) -> int:
    """The packed form takes whole panels: round the output count up to one."""
    width = library.panel_width
    return num_outputs if form == "dot" else -(-num_outputs // width) * width


# --- the kernel -------------------------------------------------------------------------------

SHAPES = [
    (1, 7, 5),
    (3, 13, 37),
    (6, 50, 77),
    (9, 40, 64),
    (10, 41, 100),
    (12, 40, 1030),
    (17, 100, 130),
    (40, 33, 16),
    (2, 1, 1),
    (13, 70, 2100),
]
"""(rows, outputs, inputs): K below, at and past the vector width and past the packed form's K
block (1024), N with edge columns (the dot form) and with one to several panels and a last
partial group of panels (the packed form, N rounded up to whole panels), M in one group (up to
the AVX2 build's 12 rows, its tallest one-pass tile) and in several (with groups of two heights)."""


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("num_rows,num_outputs,num_inputs", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_kernel_matches_a_float64_reference(library, form, num_rows, num_outputs, num_inputs, with_bias):
    num_outputs = output_count(library, form, num_outputs)
    generator = torch.Generator().manual_seed(num_rows * 1000 + num_inputs)
    rows, weight = torch.randn(num_rows, num_inputs, generator=generator), torch.randn(num_outputs, num_inputs, generator=generator)
    bias = torch.randn(num_outputs, generator=generator) if with_bias else None
    expected = torch.nn.functional.linear(rows.double(), weight.double(), None if bias is None else bias.double())
    tolerance = 1e-6 * (num_inputs + 1) * (rows.abs().max() * weight.abs().max() + 1).item()
    assert (kernel_linear(library, rows, weight, bias, form=form).double() - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("num_rows", [2, 3, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 40])
def test_kernel_row_is_bitwise_the_same_alone_or_among_others(library, form, num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    num_outputs, num_inputs = output_count(library, form, 75), 100 if form == "dot" else 1100
    rows = torch.randn(num_rows, num_inputs, generator=generator)
    weight, bias = torch.randn(num_outputs, num_inputs, generator=generator), torch.randn(num_outputs, generator=generator)
    together = kernel_linear(library, rows, weight, bias, form=form)
    alone = torch.cat([kernel_linear(library, rows[index : index + 1].clone(), weight, bias, form=form) for index in range(num_rows)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("num_rows", [9, 20])
def test_kernel_output_does_not_depend_on_the_thread_count(library, form, num_rows):
    generator = torch.Generator().manual_seed(7)
    rows, weight = torch.randn(num_rows, 256, generator=generator), torch.randn(output_count(library, form, 700), 256, generator=generator)
    one_thread = kernel_linear(library, rows, weight, None, threads=1, form=form)
    assert torch.equal(one_thread, kernel_linear(library, rows, weight, None, threads=2, form=form))


def kernel_has_populate_write() -> bool:
    """madvise(MADV_POPULATE_WRITE) exists on Linux 5.14 and later."""
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", platform.release()).groups())
    return (major, minor) >= (5, 14)


# --- the batch-invariant attention -----------------------------------------------------------


def attention_inputs(num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, num_keys: int, seed: int = 0):
    """query [1, heads, rows, d] as transformers hands it (a transposed view), key and value
    [1, kv heads, keys, d] as views into a larger buffer (the growing cache's spare room)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, num_rows, num_heads, head_dim, generator=generator).transpose(1, 2)
    buffers = [torch.randn(1, num_kv_heads, num_keys + 7, head_dim, generator=generator) * 2 for _ in range(2)]
    return query, buffers[0][:, :, :num_keys], buffers[1][:, :, :num_keys]


def torch_rowwise(query, key, value, scaling) -> torch.Tensor:
    """The torch path of rowwise_attention (no kernel on the module)."""
    return rowwise_attention(torch.nn.Module(), query, key, value, None, scaling)[0]


ATTENTION_SHAPES = [  # rows, heads, KV heads, head_dim, keys
    (1, 4, 2, 16, 1),
    (9, 4, 2, 16, 20),
    (9, 12, 2, 128, 300),
    (5, 8, 8, 64, 37),
    (16, 6, 1, 32, 16),
    (3, 14, 2, 64, 1000),
]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_attention_kernel_matches_torch_rowwise_attention(library, shape):
    query, key, value = attention_inputs(*shape)
    assert library.can_attend(query, key, value)
    scaling = shape[3] ** -0.5
    expected = torch_rowwise(query, key, value, scaling)
    got = library.rowwise_attention(query, key, value, scaling)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("num_rows", [2, 9, 16])
def test_attention_kernel_row_is_bitwise_the_same_alone_or_among_others(library, num_rows):
    """Row r of an R-row call equals a one-row call at its position (keys up to its own), bitwise,
    whatever the thread count."""
    query, key, value = attention_inputs(num_rows, 12, 2, 128, 200, seed=num_rows)
    block = library.rowwise_attention(query, key, value, 0.125)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for row in range(num_rows):
                visible = 200 - num_rows + row + 1
                alone = library.rowwise_attention(query[:, :, row : row + 1], key[:, :, :visible], value[:, :, :visible], 0.125)
                assert torch.equal(alone[0, 0], block[0, row]), (threads, row)
    finally:
        torch.set_num_threads(previous)


def test_attention_the_kernel_cannot_take_goes_through_torch(library):
    query, key, value = attention_inputs(2, 4, 2, 20, 10)  # head_dim not a multiple of the vector width
    assert not library.can_attend(query, key, value)
    assert not library.can_attend(*(tensor.double() for tensor in (query, key, value)))
    module = torch.nn.Module()
    setattr(module, KERNEL_ATTRIBUTE, library)
    assert torch.equal(rowwise_attention(module, query, key, value, None, 0.2)[0], torch_rowwise(query, key, value, 0.2))


def test_an_unwritable_cache_builds_the_kernel_in_the_fallback_directory(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache should be: nothing can be created under it, even by root")
    monkeypatch.setattr(cpu_kernels, "fallback_kernel_dir", lambda: tmp_path / "fallback")
    built = load_kernel_library(blocker / "cache")
    assert built is not None and built.path.parent == tmp_path / "fallback"
    assert "cannot build or load in" in caplog.text and str(blocker) in caplog.text
    rows = torch.randn(2, 40)
    weight = torch.randn(16, 40)
    torch.testing.assert_close(built.linear(rows, weight, None), rows @ weight.T, rtol=1e-5, atol=1e-5)


def test_prefaulting_for_writing_keeps_the_contents_and_leaves_the_file_alone(tmp_path):
    # A privately memory-mapped file, as a safetensors checkpoint is loaded; the tensor starts
    # mid-page, so its first page holds values before it too.
    path = tmp_path / "weights.bin"
    values = torch.arange(3 * 4096, dtype=torch.float32)
    values.numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=values.numel(), dtype=torch.float32)
    weight = mapped[1000:]
    assert prefault_for_writing([weight, mapped[:0]]) == (1 if kernel_has_populate_write() else 0)
    assert torch.equal(mapped, values)
    weight.fill_(-1.0)
    assert torch.equal(mapped[:1000], values[:1000])
    assert torch.equal(torch.from_file(str(path), shared=False, size=values.numel(), dtype=torch.float32), values)


def test_only_weights_a_layer_alone_reads_with_whole_panels_are_packed():
    embedding, tied, own, ragged = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64), torch.nn.Linear(16, 64), torch.nn.Linear(16, 40)
    tied.weight = embedding.weight  # tied input and output embeddings
    model = torch.nn.ModuleList([embedding, tied, own, ragged])
    shared = shared_parameters(model)
    assert [can_pack(layer, 32, shared) for layer in (tied, own, ragged)] == [False, True, False]


# --- the whole model --------------------------------------------------------------------------


def block_logits(model, token_ids: list[int], prefix_length: int, num_rows: int, new_cache=None) -> torch.Tensor:
    """Logits of rows [prefix_length, prefix_length + num_rows) fed as one block after a cached prefix."""
    cache = (new_cache or dynamic_cache)(model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([token_ids[:prefix_length]]), use_cache=True, **{cache_argument_name(model): cache})
        block = torch.tensor([token_ids[prefix_length : prefix_length + num_rows]])
        return model(input_ids=block, use_cache=True, **{cache_argument_name(model): cache}).logits[0]


def dynamic_cache(config) -> DynamicCache:
    return DynamicCache(config=config)


def stepwise_logits(model, token_ids: list[int], prefix_length: int, num_rows: int, new_cache=None) -> torch.Tensor:
    return torch.stack([block_logits(model, token_ids, prefix_length + row, 1, new_cache)[0] for row in range(num_rows)])


PREFIX = 20
TOKENS = random_tokens(random.Random(0), PREFIX + 16, 384)


CACHES = {"dynamic": dynamic_cache, "growing": growing_cache}


@pytest.mark.parametrize("cache_kind", CACHES)
def test_batch_invariant_rows_are_bitwise_equal_to_one_token_steps(model, library, cache_kind, monkeypatch):
    calls = []
    attend = cpu_kernels.KernelLibrary.rowwise_attention

    def counted(self, *args):
        calls.append(args[0].shape)
        return attend(self, *args)

    monkeypatch.setattr(cpu_kernels.KernelLibrary, "rowwise_attention", counted)
    assert_rows_bitwise_equal_to_one_token_steps(model, library, cache_kind)
    assert len(calls) >= model.config.num_hidden_layers * 15  # every layer's attention of every block went through the kernel


@pytest.mark.parametrize("cache_kind", CACHES)
def test_batch_invariant_rows_without_the_kernel_are_bitwise_equal_to_one_token_steps(model, cache_kind):
    assert_rows_bitwise_equal_to_one_token_steps(model, None, cache_kind)  # torch, row by row


def assert_rows_bitwise_equal_to_one_token_steps(model, library, cache_kind: str) -> None:
    patch = apply_cpu_kernels(model, library, batch_invariant=True)
    new_cache = CACHES[cache_kind]
    steps = stepwise_logits(model, TOKENS, PREFIX, 16, new_cache)
    unequal = [
        num_rows for num_rows in range(2, 17) if not torch.equal(block_logits(model, TOKENS, PREFIX, num_rows, new_cache), steps[:num_rows])
    ]
    assert (patch.mode, unequal) == ("batch_invariant", [])


def test_growing_cache_gives_the_logits_of_dynamic_cache_through_appends_and_crops(model):
    """Prefill 20, then blocks of 9 with 0-9 rows cropped after each (rejected drafts), past the
    buffer's spare room several times: every forward's logits are bitwise transformers' own."""
    caches = [DynamicCache(config=model.config), growing_cache(model.config)]
    rng = random.Random(4)
    feeds = [TOKENS[:PREFIX]] + [random_tokens(rng, 9, 384) for _ in range(40)]
    for feed in feeds:
        with torch.inference_mode():
            logits = [
                model(input_ids=torch.tensor([feed]), use_cache=True, **{cache_argument_name(model): cache}).logits for cache in caches
            ]
        assert torch.equal(*logits)
        num_rejected = rng.randrange(0, 10)
        for cache in caches:
            cache.crop(-num_rejected)
    lengths = [cache.get_seq_length() for cache in caches]
    spare = [layer._key_buffer.shape[-2] - layer.keys.shape[-2] for layer in caches[1].layers]
    assert lengths[0] == lengths[1] > PREFIX and all(0 <= room <= GROWTH_TOKENS + 9 for room in spare)


def test_fast_mode_stays_within_fp32_rounding_of_stock_and_keeps_its_argmax(model, library):
    stock = [block_logits(model, TOKENS, prefix, 9) for prefix in (1, PREFIX)]
    apply_cpu_kernels(model, library, batch_invariant=False)
    fast = [block_logits(model, TOKENS, prefix, 9) for prefix in (1, PREFIX)]
    scale = max(logits.abs().max().item() for logits in stock)
    assert max((a - b).abs().max().item() for a, b in zip(fast, stock, strict=True)) <= 1e-5 * scale
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(fast, stock, strict=True))


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fast", "batch-invariant"])
def test_removing_the_patch_restores_stock_transformers_exactly(model, library, batch_invariant):
    original = {name: parameter.clone() for name, parameter in model.named_parameters()}
    stock = block_logits(model, TOKENS, PREFIX, 9)
    patch = apply_cpu_kernels(model, library, batch_invariant)
    block_logits(model, TOKENS, PREFIX, 9)
    carrying = [module for module in model.modules() if hasattr(module, KERNEL_ATTRIBUTE)]
    assert len(carrying) == (model.config.num_hidden_layers if batch_invariant else 0)
    assert patch.attention == ("spade_rowwise (kernel-" + library.isa.lower() + ")" if batch_invariant else "spade_gqa")
    permuted = [name for name, parameter in model.named_parameters() if not torch.equal(parameter, original[name])]
    assert len(permuted) == len(patch.packed) > 0  # packed in place, nothing else touched
    patch.remove()
    assert all(torch.equal(parameter, original[name]) for name, parameter in model.named_parameters())
    assert not any("forward" in vars(module) or hasattr(module, KERNEL_ATTRIBUTE) for module in model.modules())
    assert torch.equal(block_logits(model, TOKENS, PREFIX, 9), stock)
    assert attention_implementation(model) == "eager"


def test_every_linear_layer_of_the_model_goes_through_the_kernel(model, library):
    patch = apply_cpu_kernels(model, library, batch_invariant=False)
    num_linears = sum(isinstance(module, torch.nn.Linear) for module in model.modules())
    assert (patch.num_linears, patch.linear_path, patch.attention) == (num_linears, f"kernel-{library.isa.lower()}", "spade_gqa")


def system_compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the kernel is built for x86 with gcc/cc")
    return compiler


@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "one-thread"])
@pytest.mark.parametrize("isa", sorted(ISA_FLAGS))
def test_the_kernel_compiles_without_a_warning(tmp_path, isa, openmp):
    """The very build the verifier runs (-Wall -Wextra), for both ISAs (compiling needs no such
    CPU) and both with OpenMP and without (the fallback build): the compiler prints nothing."""
    command = compile_command(system_compiler(), ISA_FLAGS[isa], str(tmp_path / "kernel.so"), openmp)
    assert {"-Wall", "-Wextra"} <= set(command)
    build = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert (build.returncode, build.stderr) == (0, "")


def innermost_loops(assembly: str) -> dict[str, list[list[str]]]:
    """Per function of gcc/clang AT&T assembly, the bodies of its innermost loops: the lines from a
    label to the backward jump to it, with no other backward jump inside."""
    loops: dict[str, list[list[str]]] = {}
    for function in re.finditer(r"^(\w+):\n(.*?)\.cfi_endproc", assembly, re.S | re.M):
        lines = function.group(2).splitlines()
        labels = {line.strip()[:-1]: index for index, line in enumerate(lines) if re.match(r"^\.L\w+:$", line.strip())}
        backward = [
            (labels[jump.group(1)], index)
            for index, line in enumerate(lines)
            if (jump := re.match(r"\s+j\w+\s+(\.L\w+)$", line)) and labels.get(jump.group(1), index) < index
        ]
        loops[function.group(1)] = [
            lines[start:end]
            for start, end in backward
            if not any(start < inner < end for inner, _ in backward if (inner, _) != (start, end))
        ]
    return loops


@pytest.mark.parametrize("isa", sorted(ISA_FLAGS))
def test_every_tile_keeps_its_accumulators_in_registers(tmp_path, isa):
    """No vector register goes to the stack inside a tile's loop over k: a spilled accumulator is
    stored and reloaded on every k, and the tile runs at a fraction of its speed. (gcc 12 did this
    to every AVX2 packed tile while their broadcasts went through _mm256_broadcast_ss.)"""
    assembly = tmp_path / "kernel.s"
    command = compile_command(system_compiler(), ISA_FLAGS[isa], str(assembly), openmp=True)
    command = [argument for argument in command if argument not in ("-shared", "-fPIC")] + ["-S"]
    subprocess.run(command, check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
    loops = {name: bodies for name, bodies in innermost_loops(assembly.read_text()).items() if re.match(r"(tile|panels)_\d+x\d+$", name)}
    fma_loops = {name: [body for body in bodies if any("vfmadd" in line for line in body)] for name, bodies in loops.items()}
    assert len(fma_loops) >= 15 and all(fma_loops.values())  # every tile shape, each with its k loop found
    spilling = {name for name, bodies in fma_loops.items() for body in bodies for line in body if "(%rsp)" in line and "mm" in line}
    assert spilling == set()


def test_the_kernel_exports_exactly_what_the_python_side_calls(library):
    """No unused export: the library's defined functions are the ``library.spade_*`` the loader
    binds and calls."""
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) lists the library's symbols")
    listing = subprocess.run(["nm", "-D", "--defined-only", str(library.path)], capture_output=True, text=True, check=True).stdout
    exported = {fields[2] for fields in map(str.split, listing.splitlines()) if len(fields) == 3 and fields[1] == "T"}
    called = set(re.findall(r"library\.(spade_\w+)", KERNEL_SOURCE.with_suffix(".py").read_text()))
    assert (
        exported
        == called
        == {
            "spade_linear",
            "spade_packed_linear",
            "spade_panel_width",
            "spade_rowwise_attention",
            "spade_attention_lanes",
        }
    )


def test_kernels_are_not_applied_off_float32(tiny_pair):
    model = load_model(ModelSource(str(tiny_pair.target_dir)), dtype="bfloat16").model
    assert prepare_cpu_kernels(model, fast_kernels=True, batch_invariant=False) is None
    assert prepare_cpu_kernels(model, fast_kernels=True, batch_invariant="preferred") is None  # the default: no error
    with pytest.raises(ValueError, match="batch-invariant"):
        prepare_cpu_kernels(model, fast_kernels=True, batch_invariant=True)


def test_the_default_batch_invariance_needs_the_compiled_kernel(tiny_pair, library, tmp_path, monkeypatch):
    # Preferred (the default): batch-invariant where the kernel runs; without a compiler the
    # fast mode, not the row-by-row torch linears (slow). Required: batch-invariant either way.
    def fresh_model():
        return load_model(ModelSource(str(tiny_pair.target_dir))).model

    monkeypatch.setattr(cpu_kernels, "load_kernel_library", lambda cache_dir, isa=None: library)
    assert prepare_cpu_kernels(fresh_model(), True, "preferred", tmp_path).mode == "batch_invariant"
    monkeypatch.setattr(cpu_kernels, "load_kernel_library", lambda cache_dir, isa=None: None)
    assert prepare_cpu_kernels(fresh_model(), True, "preferred", tmp_path).mode == "fast"
    assert prepare_cpu_kernels(fresh_model(), True, "required", tmp_path).linear_path == "torch-rowwise"


@pytest.mark.parametrize("isa", runnable_isas() or [None])
def test_the_kernel_isa_asked_for_is_the_one_the_model_runs(tiny_pair, tmp_path, isa):
    """--cpu-kernel-isa AVX2 on an AVX-512 CPU builds and runs the AVX2 kernel; auto the best."""
    if isa is None:
        pytest.skip("the CPU kernel cannot be built here (needs AVX2 or AVX-512 and gcc/cc)")
    patch = prepare_cpu_kernels(load_model(ModelSource(str(tiny_pair.target_dir))).model, True, "preferred", tmp_path, isa=isa)
    assert (patch.linear_path, patch.mode) == (f"kernel-{isa.lower()}", "batch_invariant")
    assert prepare_cpu_kernels(load_model(ModelSource(str(tiny_pair.target_dir))).model, True, "preferred", tmp_path).linear_path == (
        f"kernel-{runnable_isas()[0].lower()}"
    )


def test_a_kernel_isa_the_cpu_lacks_stops_the_verifier_with_the_reason(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "runnable_isas", lambda: ["AVX2"])
    with pytest.raises(ValueError, match="this CPU cannot run the AVX512 kernel \\(it runs \\['AVX2'\\]\\)"):
        prepare_cpu_kernels(load_model(ModelSource(str(tiny_pair.target_dir))).model, True, "preferred", tmp_path, isa="AVX512")


def test_the_verifier_setting_takes_the_kernel_isas_and_nothing_else():
    from pydantic import ValidationError

    from verifier_service.settings import VerifierSettings

    assert VerifierSettings().cpu_kernel_isa == "auto" and VerifierSettings(cpu_kernel_isa="AVX2").cpu_kernel_isa == "AVX2"
    with pytest.raises(ValidationError):
        VerifierSettings(cpu_kernel_isa="SSE4")


def test_without_a_compiler_there_is_no_kernel_and_the_log_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert load_kernel_library(tmp_path) is None
    assert "CPU kernels" in caplog.text and "no-such-compiler" in caplog.text


def test_fast_mode_without_the_kernel_keeps_stock_linears(model):
    patch = apply_cpu_kernels(model, None, batch_invariant=False)
    assert (patch.linear_path, patch.num_linears, patch.attention) == ("torch", 0, "spade_gqa")


def test_no_kernels_when_both_settings_are_off(model):
    assert prepare_cpu_kernels(model, fast_kernels=False, batch_invariant=False) is None


# --- the service ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_drafted,num_target_tokens,label",
    [
        (0, 1, "0"),
        (8, 9, "8"),
        (16, 17, "16"),
        (17, 18, "17+"),
        (40, 41, "17+"),
        (3, 20, "prefill"),
        (0, 12, "prefill"),
    ],
)
def test_block_label(num_drafted, num_target_tokens, label):
    assert block_label(num_drafted, num_target_tokens) == label


@pytest.fixture(scope="module")
def invariant_client(tiny_pair, library):
    with running_verifier(tiny_pair, batch_invariant=True) as client:
        yield client


def by_block_counts(client) -> dict[str, float]:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return {
        sample.labels["num_drafted"]: sample.value
        for family in families
        for sample in family.samples
        if sample.name == "spade_verifier_forward_seconds_by_block_count"
    }


def test_verify_answers_match_a_plain_forward_in_the_batch_invariant_mode(invariant_client, target_model):
    rng = random.Random(3)
    model = target_model.model
    for num_accepted in (0, 2, 4):
        context = random_tokens(rng, 12, 384)
        block = greedy_block(model, context, 4, num_accepted, 384, rng)
        answer = verify(invariant_client, verify_body(new_session_id(), [], block, new_tokens=context))
        assert verdict(answer) == reference_verdict(model, context, block)


def test_verify_timings_report_the_model_call_within_the_forward(invariant_client):
    answer = verify(invariant_client, verify_body(new_session_id(), [], [5, 6, 7], new_tokens=[3, 4, 8, 9]))
    timings = answer["timings"]
    assert 0 < timings["model_ms"] <= timings["forward_ms"] <= timings["total_ms"]


def test_metrics_count_forwards_per_draft_length(tiny_pair, library):
    """A fresh call prefills (label 'prefill'), its follow-up with 3 drafted tokens feeds 4 rows
    (label '3'); a 5-token target-only completion (no EOS in it) is one prefill step and four
    one-row steps."""
    with running_verifier(tiny_pair) as client:
        first = verify(client, verify_body("s", [], [5, 6], new_tokens=[3, 4, 8, 9]))
        committed = [3, 4, 8, 9] + [5, 6][: first["num_accepted"]] + [first["next_token"]]
        verify(client, verify_body("s", committed, [7, 8, 9]))
        completion = client.post("/v1/completions", json={"model": "target", "prompt": [3, 4, 5], "max_tokens": 5, "temperature": 0})
        num_steps = completion.json()["usage"]["completion_tokens"]
        counts = by_block_counts(client)
    assert (num_steps, counts) == (5, {"prefill": 2.0, "3": 1.0, "0": 4.0})


@pytest.fixture(scope="module")
def invariant_verifier_url(tiny_pair, library):
    with serve(full_context_verifier_app(tiny_pair, batch_invariant=True)) as url:
        yield url


@pytest.fixture(scope="module")
def invariant_target_outputs(invariant_verifier_url):
    client = openai.OpenAI(base_url=invariant_verifier_url + "/v1", api_key="unused", max_retries=0)
    return {case.id: generate(client, case) for case in TINY_PAIR_CASES if not case.stream}


@pytest.mark.parametrize("draft_length", ["1", "5", "8", "auto"])
def test_greedy_output_equals_target_only_with_a_batch_invariant_verifier(
    tiny_pair, invariant_verifier_url, invariant_target_outputs, draft_length
):
    with serve(edge_app(tiny_pair, invariant_verifier_url, draft_length=draft_length)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        outputs = {case.id: generate(client, case) for case in TINY_PAIR_CASES if not case.stream}
    assert outputs == invariant_target_outputs
