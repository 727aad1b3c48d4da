"""``spade_bench.micro.rows_bench`` and ``spade_bench.micro.forward_bench``: the forward cost per row count
(the tiny target here; the real one in docs/runs/run-r.md), per kernel ISA, beside the core's
physics (``spade_bench.micro.cpu_physics``)."""

from __future__ import annotations

import re

import pytest

from spade_bench.micro import forward_bench
from spade_bench.micro.cpu_physics import CorePhysics, cpuinfo_fields, measure_core, parse_isas
from spade_bench.micro.forward_bench import LinearSizes, efficiency_cells, expand_variants, parse_counts, split_variant, variant_name
from spade_bench.micro.rows_bench import main, split_rows
from verifier_service.backends.transformers.cpu.kernels import runnable_isas


def test_rows_are_split_as_evenly_as_they_go_and_no_session_is_left_empty():
    assert split_rows(10, 4) == [3, 3, 2, 2]
    assert split_rows(2, 8) == [1, 1]
    assert split_rows(8, 1) == [8]


def test_the_bench_prints_and_writes_its_tables(tmp_path, capsys):
    main(["--rows", "1,4", "--sessions", "1,2", "--repeats", "1", "--context-length", "8", "--output", str(tmp_path)])
    report = (tmp_path / "rows_bench.md").read_text()
    assert (
        "| 4 |" in report and re.search(r"fast( \(\w+\))?, 2 sess\.", report) and re.search(r"batch_invariant( \(\w+\))?, 1 sess\.", report)
    )
    assert "batch-invariant / fast" in report
    assert report.strip() in capsys.readouterr().out


def test_every_isa_asked_for_gets_its_own_columns_and_physics(tmp_path):
    isas = runnable_isas()
    if not isas:
        pytest.skip("no kernel ISA on this CPU: the bench runs without the kernel (see the log)")
    main(
        ["--isa", ",".join(isas), "--rows", "1,2", "--sessions", "1", "--repeats", "1", "--context-length", "8", "--output", str(tmp_path)]
    )
    report = (tmp_path / "rows_bench.md").read_text()
    for isa in isas:
        assert f"fast ({isa}), 1 sess." in report and f"t(R)/t(1), batch_invariant ({isa})" in report
        assert re.search(rf"^{isa}: .*stream read [\d.]+ GB/s, {isa} in-register FMA \d+ GFLOP/s$", report, re.M)


def test_an_isa_this_cpu_cannot_run_is_refused_by_name():
    with pytest.raises(SystemExit, match="--isa SSE2: this CPU runs"):
        parse_isas("SSE2")
    assert parse_isas(None) == runnable_isas()[:1] and parse_isas("avx2") == (["AVX2"] if "AVX2" in runnable_isas() else parse_isas("avx2"))


def test_counts_take_lists_and_inclusive_ranges():
    assert parse_counts("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_counts("0-15") == list(range(16))
    assert parse_counts("4") == [4]


def test_a_variant_names_its_mode_and_kernel_and_stock_runs_once():
    assert expand_variants(["stock", "fast"], ["AVX512", "AVX2"]) == ["stock", "fast (AVX512)", "fast (AVX2)"]
    assert split_variant(variant_name("batch_invariant", "AVX2 old")) == ("batch_invariant", "AVX2 old")
    assert split_variant("stock") == ("stock", None) and variant_name("fast", None) == "fast"


def test_what_a_forward_achieved_is_its_weights_and_flops_over_its_time_against_the_core():
    sizes = LinearSizes(body_parameters=1_000_000_000, head_parameters=250_000_000)
    core = CorePhysics("AVX2", "a CPU", 3000.0, stream_gbps=10.0, fma_gflops=100.0)
    # 5 GB of weights in 1 s; 9 rows: 2 x (1e9 x 9 + 2.5e8 x 9) = 22.5 GFLOP.
    assert efficiency_cells(1.0, sizes, 9, 9, core) == "5.0 (50%) | 22.5 (22%)"
    # A prefill keeps one row's logits: 2 x (1e9 x 512 + 2.5e8) FLOPs.
    assert efficiency_cells(2.0, sizes, 512, 1, None) == "2.5 | 512.2"


def test_cpuinfo_gives_the_model_and_clock_of_the_cpu_asked_for():
    text = "processor\t: 0\nmodel name\t: CPU A\ncpu MHz\t\t: 2600.000\n\nprocessor\t: 1\nmodel name\t: CPU A\ncpu MHz\t\t: 3100.5\n"
    assert cpuinfo_fields(text, 1)["cpu MHz"] == "3100.5"
    assert cpuinfo_fields(text, 7)["processor"] == "0"  # a CPU with no block: the first


@pytest.mark.parametrize("isa", runnable_isas() or [None])
def test_the_physics_probe_measures_each_isa(isa):
    if isa is None:
        pytest.skip("no kernel ISA on this CPU: nothing to probe")
    physics = measure_core(isa, read_bytes=64 << 20)
    assert physics is not None and physics.isa == isa and physics.stream_gbps > 0 and physics.fma_gflops > 0
    assert isa in physics.describe()


def test_the_forward_bench_prints_its_curve_prefill_and_physics_per_isa(tmp_path, capsys):
    isas = runnable_isas()
    argv = ["--context-lengths", "8", "--drafted", "0,2", "--repeats", "1", "--prefill-rows", "16", "--prefill-repeats", "1"]
    argv += ["--modes", "fast", "--breakdown", "", "--check-blocks", "1,2", "--output", str(tmp_path)]
    forward_bench.main(argv + (["--isa", ",".join(isas)] if isas else []))
    report = (tmp_path / "forward_bench.md").read_text()
    assert "16-row prefill, CPU s" in report and "t(R)/t(1)" in report
    for isa in isas:
        assert f"| fast ({isa}) | 3 |" in report and f"fast ({isa}): row 0 of an M-row block bitwise equal" in report
