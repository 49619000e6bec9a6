"""Fused elementwise kernels for the GPU path: residual add + RMSNorm, and SiLU-and-mul.

Each replaces several torch kernels (and their round trips through HBM) by one pass per
row: at small decode batches these launches and reads are a visible share of a step.
Math in fp32, results in the input dtype, like the torch reference
(ferry/layers/fused.py), which the tests compare them with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.triton_compat import apply_interpreter_numpy_fix

apply_interpreter_numpy_fix()


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps, N: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    s = x + r
    tl.store(res_ptr + row * stride_r + cols, s.to(res_ptr.dtype.element_ty), mask=mask)
    # Normalise what the residual stream holds (rounded to its dtype), as the unfused path does.
    s = s.to(res_ptr.dtype.element_ty).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual) * weight. x, residual: [T, N]."""
    T, N = x.shape
    out = torch.empty_like(x)
    if T:
        _add_rms_norm_kernel[(T,)](x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), eps,
                                   N=N, BLOCK=triton.next_power_of_2(N))  # fmt: skip
    return out


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_in, stride_out, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(gu_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_in + N + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2N] (gate | up) -> silu(gate) * up, [T, N]."""
    T, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(T, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), N=n,
                                                           BLOCK=block)  # fmt: skip
    return out
