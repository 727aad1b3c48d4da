"""The shipped verifier-pool config (docker/nginx/verifier-pool.conf) run by a real nginx on
loopback: rendered with its listen port and replica addresses moved to 127.0.0.1, inside the
process-level settings the nginx image supplies (pid, logs, temp paths).

Used by ``spade_bench.pool.bench`` and the deployment tests (tests/deploy_support.py, which
skips where nginx is missing)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
NGINX_POOL_CONF = ROOT / "docker" / "nginx" / "verifier-pool.conf"
NGINX_PATHS = ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
ROUTE_BY_PREFIX = "    default $http_x_spade_route;"
"""The line of the route map that lets the edge's prefix key (X-Spade-Route) choose the replica."""
ROUTE_BY_SESSION = "    default $spade_session;"


def find_nginx() -> str | None:
    """The nginx binary on PATH or in its usual places; None where nginx is not installed."""
    return shutil.which("nginx") or next((path for path in NGINX_PATHS if os.access(path, os.X_OK)), None)


def render_pool_config(
    directory: Path, listen_port: int, replica_ports: dict[str, int], *, route_by_prefix: bool = True, log_format: str | None = None
) -> Path:
    """Write ``directory/nginx.conf`` (including the rendered ``verifier-pool.conf``) and return it.

    ``replica_ports``: the shipped file's replica names (``verifier-a``, ...) -> loopback ports.
    ``route_by_prefix=False`` routes by session alone: the route map sends every request to its
    session key, as if the edge sent no X-Spade-Route (the baseline prefix routing is measured
    against). ``log_format``: the access log's format (nginx variables), else nginx's default.
    """
    text = NGINX_POOL_CONF.read_text()
    replacements = {"listen 8001;": f"listen 127.0.0.1:{listen_port};"}
    replacements |= {f"server {name}:8001 ": f"server 127.0.0.1:{port} " for name, port in replica_ports.items()}
    if not route_by_prefix:
        replacements[ROUTE_BY_PREFIX] = ROUTE_BY_SESSION
    for old, new in replacements.items():
        if text.count(old) != 1:
            raise ValueError(f"{NGINX_POOL_CONF.name} no longer has {old!r} exactly once")
        text = text.replace(old, new)
    (directory / "verifier-pool.conf").write_text(text)
    temp_paths = "\n".join(f"    {kind}_temp_path {directory / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    access_log = f"    access_log {directory / 'access.log'};\n"
    if log_format is not None:
        access_log = f"    log_format spade '{log_format}';\n    access_log {directory / 'access.log'} spade;\n"
    main = directory / "nginx.conf"
    main.write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"daemon off;\nworker_processes 1;\npid {directory / 'nginx.pid'};\nerror_log {directory / 'error.log'} info;\n"
        + "events {}\nhttp {\n"
        + f"{access_log}{temp_paths}\n    include {directory / 'verifier-pool.conf'};\n}}\n"
    )
    return main


@contextlib.contextmanager
def running_nginx(config: Path, listen_port: int, binary: str, timeout_s: float = 30.0) -> Iterator[str]:
    """Run nginx in the foreground on ``config``; yield its base URL once it answers. Start the
    replicas first: the probe reaches one, and a replica that refuses it is skipped for the
    config's ``fail_timeout``."""
    process = subprocess.Popen([binary, "-c", str(config), "-p", str(config.parent)], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{listen_port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _accepts(url):
            if process.poll() is not None:
                raise RuntimeError(f"nginx exited: {process.stderr.read() if process.stderr else ''}")
            if time.monotonic() > deadline:
                raise TimeoutError("nginx did not start")
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _accepts(url: str) -> bool:
    with contextlib.suppress(httpx.TransportError):
        httpx.get(url + "/health", timeout=5)
        return True
    return False
