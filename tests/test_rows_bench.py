"""``spade_bench.rows_bench``: the forward cost per row count through the verifier's ragged
forward (the tiny target here; the real one in docs/benchmarks.md)."""

from __future__ import annotations

from spade_bench.rows_bench import main, split_rows


def test_rows_are_split_as_evenly_as_they_go_and_no_session_is_left_empty():
    assert split_rows(10, 4) == [3, 3, 2, 2]
    assert split_rows(2, 8) == [1, 1]
    assert split_rows(8, 1) == [8]


def test_the_bench_prints_and_writes_its_tables(tmp_path, capsys):
    main(["--rows", "1,4", "--sessions", "1,2", "--repeats", "1", "--context-length", "8", "--output", str(tmp_path)])
    report = (tmp_path / "rows_bench.md").read_text()
    assert "| 4 |" in report and "fast, 2 sess." in report and "batch_invariant, 1 sess." in report
    assert "batch-invariant / fast" in report
    assert report.strip() in capsys.readouterr().out
