"""``spade-verifier``: serve a target model for edge agents (verify API) and as a plain
OpenAI endpoint (target-only decoding)."""

from __future__ import annotations

import argparse
import logging

import torch
import uvicorn

from gateway.cli import add_settings_arguments, settings_from_arguments
from verifier_service.app import create_app
from verifier_service.settings import VerifierSettings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="spade-verifier", description=__doc__)
    add_settings_arguments(parser, VerifierSettings)
    settings = settings_from_arguments(parser, parser.parse_args(argv), VerifierSettings)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower())


if __name__ == "__main__":
    main()
