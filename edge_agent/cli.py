"""``spade-edge``: an OpenAI-compatible endpoint on the edge that drafts locally with a small
model and streams the tokens a remote verifier accepts."""

from __future__ import annotations

import argparse
import logging

import torch
import uvicorn

from edge_agent.app import create_app
from edge_agent.settings import EdgeSettings
from gateway.cli import add_settings_arguments, settings_from_arguments


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="spade-edge", description=__doc__)
    add_settings_arguments(parser, EdgeSettings)
    settings = settings_from_arguments(parser, parser.parse_args(argv), EdgeSettings)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower())


if __name__ == "__main__":
    main()
