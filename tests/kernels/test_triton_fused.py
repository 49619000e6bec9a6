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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_qkv_views(dtype):
    """The kernel rotates the q/k views of a fused qkv output in place (GQA head counts, a
    non-power-of-two half dim, scattered positions) as the torch path does, leaving v alone."""
    from ferry.layers.rotary import RotaryEmbedding, _rotate

    torch.manual_seed(0)
    T, H, KVH, D = 6, 6, 2, 48
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope = RotaryEmbedding(D, 64, 10000.0, {**llama3, "original_max_position_embeddings": 16})
    positions = torch.tensor([0, 5, 17, 63, 1, 40], device=DEVICE)
    qkv = torch.randn(T, (H + 2 * KVH) * D, device=DEVICE).to(dtype)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)
    cos = rope.cos.to(DEVICE).index_select(0, positions).unsqueeze(1)
    sin = rope.sin.to(DEVICE).index_select(0, positions).unsqueeze(1)
    # fp32 reference math on the same (rounded) inputs; the kernel also computes in fp32
    want_q = _rotate(q.float(), cos, sin).to(dtype)
    want_k = _rotate(k.float(), cos, sin).to(dtype)
    v_before = v.clone()
    fused.rotary_(positions, q, k, rope.cos.to(DEVICE), rope.sin.to(DEVICE))
    tol = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    assert torch.equal(v, v_before)
