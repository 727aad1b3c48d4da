#!/usr/bin/env python
"""Regenerate the references rendered from the code (``gateway.reference_docs``):
docs/configuration.md from the services' settings classes, docs/metrics.md from their
Prometheus registries (built afresh, no model loaded) and the ``spade`` stats model.

    .venv/bin/python scripts/reference_docs.py            # rewrite the files that are out of date
    .venv/bin/python scripts/reference_docs.py --check    # exit 1 naming them instead (tests/test_reference_docs.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edge_agent.metrics import EdgeMetrics
from edge_agent.settings import EdgeSettings
from gateway.protocol import SpadeStats
from gateway.reference_docs import configuration_page, metrics_page, stale_references, write_references
from verifier_service.metrics import VerifierMetrics
from verifier_service.settings import VerifierSettings

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python scripts/reference_docs.py"


def references(root: Path = ROOT) -> dict[Path, str]:
    """Each reference file and the text the code renders for it now."""
    settings = [("spade-verifier", VerifierSettings), ("spade-edge", EdgeSettings)]
    registries = [("spade-verifier", VerifierMetrics()), ("spade-edge", EdgeMetrics())]
    return {
        root / "docs" / "configuration.md": configuration_page(settings, COMMAND),
        root / "docs" / "metrics.md": metrics_page(registries, SpadeStats, COMMAND),
    }


def stale_message(stale: list[Path], root: Path = ROOT) -> str:
    names = ", ".join(str(path.relative_to(root)) for path in stale)
    return f"out of date with the code: {names}; regenerate with `{COMMAND}`"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    rendered = references()
    if parser.parse_args(argv).check:
        stale = stale_references(rendered)
        if stale:
            print(stale_message(stale), file=sys.stderr)
        return 1 if stale else 0
    for path in write_references(rendered):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
