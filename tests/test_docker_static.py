"""The compose demo and the Dockerfiles, checked statically (no docker needed).

The invariants: two services, each started by a console script this project declares, with
flags and env vars its settings class knows; the edge points at the verifier's port and waits
for its health; both share one model cache volume; each has a /health check on its own port;
the edge is the only published port; the two are pinned to different cores; the image copies
every package the project installs.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from spade_models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.gpu"]


def interpolate(value) -> str:
    """Compose's ``${NAME:-default}`` with nothing set in the environment."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda match: match.group(2) or "", str(value))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def flags(command: list[str]) -> dict[str, str]:
    """``["x", "--a", "1", "--b", "2"]`` -> ``{"a": "1", "b": "2"}`` (every flag here takes a value)."""
    options = command[1:]
    return {options[index].removeprefix("--"): options[index + 1] for index in range(0, len(options), 2)}


def settings_class(script: str):
    if script == "spade-verifier":
        from verifier_service.settings import VerifierSettings

        return VerifierSettings
    from edge_agent.settings import EdgeSettings

    return EdgeSettings


def test_two_services_started_by_our_console_scripts(compose, pyproject):
    services = compose["services"]
    assert set(services) == {"verifier", "edge"}
    scripts = pyproject["project"]["scripts"]
    assert services["verifier"]["command"][0] == "spade-verifier" in scripts
    assert services["edge"]["command"][0] == "spade-edge" in scripts


@pytest.mark.parametrize("service", ["verifier", "edge"])
def test_flags_and_env_vars_are_settings_fields(compose, service):
    spec = compose["services"][service]
    settings = settings_class(spec["command"][0])
    prefix = settings.model_config["env_prefix"]
    for flag in flags(spec["command"]):
        assert flag.replace("-", "_") in settings.model_fields, f"{service}: unknown flag --{flag}"
    for name in spec.get("environment", {}):
        if name != "SPADE_CACHE_DIR":
            assert name.startswith(prefix) and name.removeprefix(prefix).lower() in settings.model_fields, name
    settings(**{flag.replace("-", "_"): value for flag, value in flags(spec["command"]).items()})  # validates


def test_the_default_pair_is_served(compose):
    assert flags(compose["services"]["verifier"]["command"])["model"] == DEFAULT_TARGET
    assert flags(compose["services"]["edge"]["command"])["draft-model"] == DEFAULT_DRAFT


def test_the_edge_reaches_the_verifier_by_service_name_and_waits_for_its_health(compose):
    verifier, edge = compose["services"]["verifier"], compose["services"]["edge"]
    url = urlparse(flags(edge["command"])["verifier-url"])
    assert (url.hostname, str(url.port)) == ("verifier", flags(verifier["command"])["port"])
    assert edge["depends_on"]["verifier"]["condition"] == "service_healthy"


@pytest.mark.parametrize("service", ["verifier", "edge"])
def test_each_service_listens_everywhere_and_checks_its_own_health(compose, service):
    spec = compose["services"][service]
    options = flags(spec["command"])
    assert options["host"] == "0.0.0.0"
    check = " ".join(spec["healthcheck"]["test"])
    assert spec["healthcheck"]["test"][0] == "CMD"
    assert f"127.0.0.1:{options['port']}/health" in check
    assert spec["healthcheck"]["start_period"]  # first start pulls and dequantizes for minutes


def test_only_the_edge_port_is_published(compose):
    edge, verifier = compose["services"]["edge"], compose["services"]["verifier"]
    port = flags(edge["command"])["port"]
    assert [str(mapping) for mapping in edge["ports"]] == [f"{port}:{port}"]
    assert "ports" not in verifier


def test_both_services_share_one_model_cache_volume(compose):
    mounts = set()
    for spec in compose["services"].values():
        volume, path = spec["volumes"][0].split(":")[:2]
        assert spec["environment"]["SPADE_CACHE_DIR"] == path
        mounts.add((volume, path))
    assert len(mounts) == 1 and next(iter(mounts))[0] in compose["volumes"]


def test_the_services_are_pinned_to_different_cores(compose):
    verifier, edge = compose["services"]["verifier"], compose["services"]["edge"]
    assert interpolate(verifier["cpuset"]) != interpolate(edge["cpuset"])
    assert float(interpolate(verifier["cpus"])) > 0 and float(interpolate(edge["cpus"])) > 0
    assert interpolate(verifier["environment"]["SPADE_VERIFIER_THREADS"]) == "1"


def test_both_services_build_the_one_cpu_image(compose):
    builds = {str(spec["build"]["dockerfile"]) for spec in compose["services"].values()}
    assert builds == {"docker/Dockerfile"} and (ROOT / "docker" / "Dockerfile").is_file()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_the_image_copies_every_installed_package(dockerfile, pyproject):
    copied = re.findall(r"^COPY\s+(\S+)", dockerfile.read_text(), flags=re.MULTILINE)
    for source in copied:
        assert (ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"
    packages = {pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= set(copied)
    allowed = set(re.findall(r"^!(\S+?)/?$", (ROOT / "docker" / "Dockerfile.dockerignore").read_text(), flags=re.MULTILINE))
    assert set(copied) <= allowed, "the .dockerignore would hide a copied path"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_the_image_runs_as_a_user_with_the_cache_in_a_volume(dockerfile):
    text = dockerfile.read_text()
    assert re.search(r"^USER\s+(?!root|0\b)\S+", text, flags=re.MULTILINE)
    assert "SPADE_CACHE_DIR=/models" in text and 'VOLUME ["/models"]' in text
    assert "/health" in text
