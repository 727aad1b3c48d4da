"""One benchmark session: run the phases with a progress bar, then score, summarise and write.

Records are appended to ``requests.jsonl`` as they come, so a run cut short still leaves every
finished request on disk (``spade-bench --report-only DIR/requests.jsonl`` reports on them).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from tqdm import tqdm

from spade_bench.config import BenchConfig
from spade_bench.data import BenchItem
from spade_bench.metrics import annotate_identical, annotate_rouge
from spade_bench.plots import write_plots
from spade_bench.records import RequestRecord
from spade_bench.report import Summaries, load_records, markdown_report, write_results
from spade_bench.runner import BenchRunner

logger = logging.getLogger(__name__)

RESULTS_FILE = "results.json"
RECORDS_FILE = "requests.jsonl"
SUMMARY_FILE = "summary.md"
PLOTS_DIR = "plots"


def run_session(config: BenchConfig, items: list[BenchItem], environment: dict, show_progress: bool = True) -> str:
    """Run everything; write the outputs under ``config.output_dir``; return the Markdown report."""
    config.output_dir.mkdir(parents=True, exist_ok=True)
    records: list[RequestRecord] = []
    started = time.time()
    load_at_start = os.getloadavg()
    with (
        (config.output_dir / RECORDS_FILE).open("w") as stream,
        tqdm(total=0, unit="req", dynamic_ncols=True, disable=None if show_progress else True) as bar,
    ):  # None: no bar through a pipe

        def on_record(record: RequestRecord) -> None:
            records.append(record)
            stream.write(json.dumps(record.to_dict(), ensure_ascii=False) + "\n")
            stream.flush()
            bar.update(1)
            bar.set_postfix_str(f"{record.label} {record.tokens_per_s:.1f} tok/s", refresh=False)
            if bar.disable and show_progress:  # through a pipe: a line per request instead of the bar
                logger.info(
                    "%d/%d %s rtt=%g %s: %.2f tok/s",
                    len(records),
                    runner.num_requests,
                    record.label,
                    record.rtt_ms,
                    record.category,
                    record.tokens_per_s,
                )

        runner = BenchRunner(config, items, on_record, on_progress=bar.set_description)
        bar.total = runner.num_requests
        bar.refresh()
        runner.run()
    placement = placement_info(config, runner.observed_affinity)
    run_info = {
        "config": config.to_dict(),
        "placement": placement,
        "environment": environment,
        "num_items": len(items),
        "failures": runner.failures,
        "started": started,
        "finished": time.time(),
        # Other work on the machine competes for the pinned cores: a load average above the
        # core count means the timings are pessimistic.
        "load_average": {"start": load_at_start, "end": os.getloadavg()},
    }
    return finish(records, items_references(items), config.output_dir, run_info)


def placement_info(config: BenchConfig, observed: dict[str, list[int]]) -> dict:
    placement = config.placement
    return {
        "edge_cores": list(placement.edge_cores),
        "verifier_cores": list(placement.verifier_cores),
        "threads_per_service": placement.threads,
        "disjoint": placement.is_disjoint,
        "bench_client_and_proxy": "unpinned (one process: the user's client and the emulated link)",
        "observed_affinity": observed,
    }


def items_references(items: list[BenchItem]) -> dict[tuple[str, str], str]:
    return {(item.dataset, item.item_id): item.reference for item in items if item.reference is not None}


def finish(records: list[RequestRecord], references: dict[tuple[str, str], str], output_dir: Path, run_info: dict) -> str:
    """Score quality, summarise, and write results.json, summary.md and the plots."""
    is_greedy = run_info.get("config", {}).get("temperature", 0.0) == 0
    if is_greedy:
        annotate_identical(records)
    annotate_rouge(records, references)
    summaries = Summaries.of(records)
    write_results(output_dir / RESULTS_FILE, records, summaries, run_info)
    markdown = markdown_report(summaries, is_greedy, conditions(run_info))
    (output_dir / SUMMARY_FILE).write_text(markdown)
    write_plots(summaries, output_dir / PLOTS_DIR, title=_plot_title(run_info))
    return markdown


def conditions(run_info: dict) -> dict:
    """The run settings a reader needs next to the tables."""
    config = run_info.get("config", {})
    network = config.get("network", {})
    models = config.get("models", {})
    return {
        "models": f"draft {models.get('draft')} → target {models.get('target')} ({models.get('dtype')})",
        "generation": f"max_tokens {config.get('max_tokens')}, temperature {config.get('temperature')}",
        "link": f"RTT {network.get('rtts_ms')} ms, jitter ±{network.get('jitter_ms')} ms, "
        f"bandwidth {network.get('bandwidth_mbps') or 'unlimited'} Mbit/s per direction",
        "placement": _placement_line(run_info.get("placement", {})),
        "load average (1/5/15 min)": _load_line(run_info.get("load_average", {})),
        "failed requests": len(run_info.get("failures", [])),
        "cpu": f"{run_info.get('environment', {}).get('cpu')}, "
        f"{len(run_info.get('environment', {}).get('available_cores', []))} cores available",
    }


def _placement_line(placement: dict) -> str:
    if not placement:
        return "–"
    observed = ", ".join(f"{name} {cores}" for name, cores in placement.get("observed_affinity", {}).items())
    return (
        f"edge cores {placement['edge_cores']}, verifier cores {placement['verifier_cores']}, "
        f"{placement['threads_per_service']} torch thread(s) each; observed: {observed}; "
        f"bench client and proxy unpinned"
    )


def _load_line(load: dict) -> str:
    def triple(values) -> str:
        return "/".join(f"{value:.1f}" for value in values)

    return f"start {triple(load['start'])}, end {triple(load['end'])}" if load else "–"


def _plot_title(run_info: dict) -> str:
    models = run_info.get("config", {}).get("models", {})
    return f"{Path(str(models.get('draft', ''))).name} → {Path(str(models.get('target', ''))).name}".strip(" →")


def report_only(path: Path, output_dir: Path, items: list[BenchItem]) -> str:
    """Rebuild the report from saved records (ROUGE needs ``items`` for the references, unless
    the records carry scores already); returns the Markdown."""
    records = load_records(path)
    run_info = json.loads(path.read_text()).get("run", {}) if path.suffix == ".json" else {}
    output_dir.mkdir(parents=True, exist_ok=True)
    return finish(records, items_references(items), output_dir, run_info)
