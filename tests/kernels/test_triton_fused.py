"""The fused Triton kernels against the torch path (interpreted on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

fused = pytest.importorskip("ferry.kernels.triton_fused")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n", [64, 96])
def test_add_rms_norm(n):
    torch.manual_seed(0)
    x, res, w = torch.randn(5, n, device=DEVICE), torch.randn(5, n, device=DEVICE), torch.rand(n, device=DEVICE) + 0.5
    expected_res = x + res
    expected = F.rms_norm(expected_res, (n,), w, 1e-6)
    out = fused.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(res, expected_res)  # the residual stream is updated in place
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [48, 2048])
def test_silu_and_mul(n):
    torch.manual_seed(0)
    gu = torch.randn(3, 2 * n, device=DEVICE)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_and_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
