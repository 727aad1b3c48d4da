"""Command-line flags generated from a settings class, so flags, env vars and defaults are
defined once: ``--max-draft-length`` for field ``max_draft_length``, its help the field's
description, its default whatever the environment (SPADE_*_MAX_DRAFT_LENGTH) or the class says.

Only argparse and pydantic are imported before the flags are parsed: ``--help`` and
``--version`` answer in a fraction of a second, and the web server, torch and the models are
imported once there is something to serve (``create_app`` is handed in as a callable)."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

if typing.TYPE_CHECKING:
    from gateway.settings import ServiceSettings

DISTRIBUTION = "spade-gateway"
SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def package_version() -> str:
    """The installed distribution's version (``pyproject.toml``), or "unknown" from a bare tree."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")


def plain_text(text: str) -> str:
    """A docstring as terminal help: reST's ``literal`` markers dropped."""
    return text.replace("``", "")


def allowed_values(annotation) -> tuple[str, ...]:
    """The values of a ``Literal[...]`` setting (also inside ``Optional``), else (). A union
    with another type (``int | Literal["auto"]``) lists nothing: its help says what it takes."""
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(value) for value in typing.get_args(annotation))
    members = typing.get_args(annotation)
    literals = [member for member in members if typing.get_origin(member) is typing.Literal]
    if len(literals) == 1 and all(member is type(None) for member in members if member is not literals[0]):
        return allowed_values(literals[0])
    return ()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def ordered_fields(settings_class: type[BaseSettings]) -> list[str]:
    """The class's own settings first (what the service is: its model, its peers), then those it
    shares with the other service (``gateway.settings.ServiceSettings``)."""
    inherited = {name for base in settings_class.__mro__[1:] for name in getattr(base, "model_fields", {})}
    own = [name for name in settings_class.model_fields if name not in inherited]
    return own + [name for name in settings_class.model_fields if name in inherited]


ADVANCED_TITLE = "advanced options"
ADVANCED_DESCRIPTION = "Tuning a user seldom sets: each default is the measured or safe choice (docs/configuration.md)."
FIELD_MARKERS = frozenset({"advanced", "default_note"})
"""The keys a setting's ``json_schema_extra`` may carry: ``advanced`` (True: listed after the
user-facing flags) and ``default_note`` (what an unset or machine-dependent default comes to)."""


def field_markers(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}


def is_advanced(field: FieldInfo) -> bool:
    """A flag a user would not touch (scheduler, kernels, timeouts): ``json_schema_extra={"advanced": True}``."""
    return field_markers(field).get("advanced") is True


def env_var_name(settings_class: type[BaseSettings], name: str) -> str:
    return f"{settings_class.model_config.get('env_prefix', '')}{name}".upper()


def add_settings_arguments(parser: argparse.ArgumentParser, settings_class: type[BaseSettings]) -> None:
    """User-facing flags in the parser's own group, the advanced ones in a group after them."""
    advanced = parser.add_argument_group(ADVANCED_TITLE, ADVANCED_DESCRIPTION)
    for name in ordered_fields(settings_class):
        field = settings_class.model_fields[name]
        add_setting_argument(advanced if is_advanced(field) else parser, name, field, env_var_name(settings_class, name))


def add_setting_argument(group: argparse._ActionsContainer, name: str, field: FieldInfo, env_name: str) -> None:
    default = "(none)" if field.default is None else field.default
    # A bool setting given alone is true (--allow-no-auth); a value still works (--overlap false).
    switch: dict[str, Any] = {"nargs": "?", "const": "true", "metavar": "BOOL"} if field.annotation is bool else {}
    # Allowed values go in the help, not argparse choices: pydantic validates (and may
    # normalise, e.g. INFO -> info) and its message names the flag.
    values = allowed_values(field.annotation)
    choices = f" One of: {', '.join(values)}." if values else ""
    group.add_argument(
        flag_name(name),
        dest=name,
        default=argparse.SUPPRESS,
        help=f"{plain_text(field.description or '')}{choices} [env {env_name}; default {default}]",
        **switch,
    )
    if field.annotation is bool:
        group.add_argument(
            "--no-" + flag_name(name)[2:],
            dest=name,
            action="store_const",
            const="false",
            default=argparse.SUPPRESS,
            help=f"Same as {flag_name(name)} false.",
        )


def settings_from_arguments(
    parser: argparse.ArgumentParser,
    arguments: argparse.Namespace,
    settings_class: type[SettingsT],
) -> SettingsT:
    """Flags given on the command line override the environment, which overrides defaults;
    pydantic validates and converts all of them (a bad value exits with the parser's usage). A
    removed setting still in the environment exits too, naming its replacement."""
    if removed := removed_environment(settings_class, os.environ):
        parser.error("; ".join(removed))
    try:
        return settings_class(**vars(arguments))
    except ValidationError as error:
        problems = "; ".join(f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}" for e in error.errors())
        parser.error(problems)


class QuietAccessLog(logging.Filter):
    """Leaves successful calls to ``paths`` out of uvicorn's access log: the edges' verify calls
    come tens a second per edge (formatting and writing each line was ~4 % of the verifier's
    event loop) and are counted on /metrics; failed ones are still logged. A path that starts with
    ``*`` matches by its ending (``*/proposals``: every session's proposals route)."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = frozenset(path for path in paths if not path.startswith("*"))
        self.endings = tuple(path[1:] for path in paths if path.startswith("*"))

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client address, method, path with query, HTTP version, status)
        if not isinstance(args, tuple) or len(args) != 5:
            return True
        path, status = str(args[2]).split("?", 1)[0], args[4]
        return not ((path in self.paths or path.endswith(self.endings)) and isinstance(status, int) and status < 400)


def removed_settings(settings_class: type[BaseSettings]) -> Mapping[str, str]:
    """The settings a class once had, each with what replaced it (``REMOVED_SETTINGS`` on the
    class; CHANGELOG.md says when each went)."""
    return getattr(settings_class, "REMOVED_SETTINGS", {})


class RemovedFlag(argparse.Action):
    """A flag that went: giving it (with or without a value) exits with what replaced it, not
    argparse's "unrecognized arguments", so a script written for an earlier version says what
    to change. Hidden from --help."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.replacement = replacement

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        parser.error(f"{option_string} was removed: {self.replacement}")


def add_removed_arguments(parser: argparse.ArgumentParser, settings_class: type[BaseSettings]) -> None:
    for name, replacement in removed_settings(settings_class).items():
        parser.add_argument(flag_name(name), action=RemovedFlag, replacement=replacement)


def removed_environment(settings_class: type[BaseSettings], environ: Mapping[str, str]) -> list[str]:
    """One message per removed setting still set in the environment (pydantic ignores an env var
    it has no field for: without this, a deployment's old variable would silently do nothing)."""
    return [
        f"{env_var_name(settings_class, name)} was removed: {replacement}"
        for name, replacement in removed_settings(settings_class).items()
        if env_var_name(settings_class, name) in environ
    ]


def service_parser(prog: str, description: str, settings_class: type[BaseSettings]) -> argparse.ArgumentParser:
    """A service's command line: --version, then its settings as flags, user-facing ones first."""
    # The usage line names no flag: listing all forty would bury the user-facing group below it.
    parser = argparse.ArgumentParser(prog=prog, usage="%(prog)s [options]", description=plain_text(description))
    add_version_argument(parser)
    add_settings_arguments(parser, settings_class)
    add_removed_arguments(parser, settings_class)
    return parser


def run_service(prog: str, description: str, settings_class: type[ServiceSettings], create_app: Callable, argv: list[str] | None) -> None:
    """Parse flags into settings, set up logging and torch threads, serve the app."""
    parser = service_parser(prog, description, settings_class)
    settings = settings_from_arguments(parser, parser.parse_args(argv), settings_class)
    # Heavy imports only now that there is something to serve.
    import uvicorn

    from gateway.lifecycle import SHUTDOWN_MARGIN_S, DrainingServer
    from gateway.security import check_exposure

    try:
        check_exposure(settings.host, settings.api_keys(), settings.allow_no_auth)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.log_level != "debug":  # httpx logs every call at INFO: one line per verify call and health poll
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        # uvicorn waits this long for requests in flight; the app's drain ends streams sooner.
        # uvicorn annotates the timeout int but hands it to asyncio.timeout, which takes float seconds.
        timeout_graceful_shutdown=settings.shutdown_grace_s + SHUTDOWN_MARGIN_S,  # type: ignore[arg-type]
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
    )
    unlogged = tuple(getattr(app.state, "unlogged_paths", ()))
    if unlogged and settings.log_level != "debug":  # after uvicorn.Config: it configures the access logger
        logging.getLogger("uvicorn.access").addFilter(QuietAccessLog(unlogged))
    DrainingServer(config, getattr(app.state, "drain", None)).run()
