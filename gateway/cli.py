"""Command-line flags generated from a settings class, so flags, env vars and defaults are
defined once: ``--max-draft-tokens`` for field ``max_draft_tokens``, its help the field's
description, its default whatever the environment (SPADE_*_MAX_DRAFT_TOKENS) or the class says."""

from __future__ import annotations

import argparse

from pydantic import ValidationError
from pydantic_settings import BaseSettings


def add_settings_arguments(parser: argparse.ArgumentParser, settings_class: type[BaseSettings]) -> None:
    env_prefix = settings_class.model_config.get("env_prefix", "")
    for name, field in settings_class.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env_name = f"{env_prefix}{name}".upper()
        default = "(none)" if field.default is None else field.default
        parser.add_argument(
            flag,
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{field.description} [env {env_name}; default {default}]",
        )


def settings_from_arguments(parser: argparse.ArgumentParser, arguments: argparse.Namespace, settings_class: type[BaseSettings]) -> BaseSettings:
    """Flags given on the command line override the environment, which overrides defaults;
    pydantic validates and converts all of them (a bad value exits with the parser's usage)."""
    try:
        return settings_class(**vars(arguments))
    except ValidationError as error:
        problems = "; ".join(f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}" for e in error.errors())
        parser.error(problems)
