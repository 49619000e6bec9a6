"""The decoder's small fp32 ops in C++ (ferry/kernels/csrc/fused_ops_cpu.cpp) against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferry.kernels.cpu import cpu_kernels
from ferry.layers.fused import add_rms_norm, rms_norm, silu_and_mul
from ferry.layers.rotary import RotaryEmbedding, _rotate

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_norms_and_activation(rows):
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g)
    weight = torch.randn(96, generator=g)
    expected_residual = residual + x
    expected = F.rms_norm(expected_residual, (96,), weight, 1e-6)
    out = add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), F.rms_norm(x, (96,), weight, 1e-6), rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(rows, 2 * 48, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_rotary_in_place_on_views_of_the_fused_qkv():
    rot = RotaryEmbedding(32, 64, 10000.0, None)
    T, H, KVH = 7, 4, 2
    qkv = torch.randn(T, (H + 2 * KVH) * 32)
    q, k, _ = qkv.split([H * 32, KVH * 32, KVH * 32], dim=-1)
    q, k = q.view(T, H, 32), k.view(T, KVH, 32)
    positions = torch.tensor([0, 3, 9, 10, 11, 40, 63])
    cos, sin = rot.cos[positions].unsqueeze(1), rot.sin[positions].unsqueeze(1)
    expected_q, expected_k = _rotate(q.clone(), cos, sin), _rotate(k.clone(), cos, sin)
    out_q, out_k = rot(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place, inside qkv
    torch.testing.assert_close(out_q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, expected_k, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="out of range"):
        rot(torch.tensor([64] * T), q, k)
