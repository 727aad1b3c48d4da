"""Command-line flags generated from a settings class, so flags, env vars and defaults are
defined once: ``--max-draft-tokens`` for field ``max_draft_tokens``, its help the field's
description, its default whatever the environment (SPADE_*_MAX_DRAFT_TOKENS) or the class says."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

import torch
import uvicorn
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from gateway.lifecycle import SHUTDOWN_MARGIN_S, DrainingServer
from gateway.security import check_exposure


def add_settings_arguments(parser: argparse.ArgumentParser, settings_class: type[BaseSettings]) -> None:
    env_prefix = settings_class.model_config.get("env_prefix", "")
    for name, field in settings_class.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env_name = f"{env_prefix}{name}".upper()
        default = "(none)" if field.default is None else field.default
        # A bool setting given alone is true (--allow-no-auth); a value still works (--overlap false).
        switch = {"nargs": "?", "const": "true"} if field.annotation is bool else {}
        parser.add_argument(
            flag,
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{field.description} [env {env_name}; default {default}]",
            **switch,
        )


def settings_from_arguments(parser: argparse.ArgumentParser, arguments: argparse.Namespace, settings_class: type[BaseSettings]) -> BaseSettings:
    """Flags given on the command line override the environment, which overrides defaults;
    pydantic validates and converts all of them (a bad value exits with the parser's usage)."""
    try:
        return settings_class(**vars(arguments))
    except ValidationError as error:
        problems = "; ".join(f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}" for e in error.errors())
        parser.error(problems)


def run_service(prog: str, description: str, settings_class: type[BaseSettings], create_app: Callable, argv: list[str] | None) -> None:
    """Parse flags into settings, set up logging and torch threads, serve the app."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_settings_arguments(parser, settings_class)
    settings = settings_from_arguments(parser, parser.parse_args(argv), settings_class)
    try:
        check_exposure(settings.host, settings.api_keys(), settings.allow_no_auth)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    app = create_app(settings)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
        # uvicorn waits this long for requests in flight; the app's drain ends streams sooner.
        timeout_graceful_shutdown=settings.shutdown_grace_s + SHUTDOWN_MARGIN_S,
        ssl_certfile=settings.ssl_certfile, ssl_keyfile=settings.ssl_keyfile,
    )
    DrainingServer(config, getattr(app.state, "drain", None)).run()
