"""Fused elementwise kernels for the GPU path: residual add + RMSNorm, SiLU-and-mul, rotary.

Each replaces several torch kernels (and their round trips through HBM) by one pass per
row: at small decode batches these launches and reads are a visible share of a step.
Math in fp32, results in the input dtype, like the torch references
(ferry/layers/fused.py, ferry/layers/rotary.py), which the tests compare them with.
Rotary works in place on the q/k views of the fused qkv projection: no copies.
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


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                   QH: tl.constexpr, KH: tl.constexpr, HALF: tl.constexpr, QH_PAD: tl.constexpr,
                   KH_PAD: tl.constexpr, HALF_PAD: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    i_ok = i < HALF
    cos = tl.load(cos_ptr + pos * stride_c + i, mask=i_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_c + i, mask=i_ok, other=0.0)[None, :]

    hq = tl.arange(0, QH_PAD)
    mq = (hq[:, None] < QH) & i_ok[None, :]
    pq = q_ptr + t * stride_qt + hq[:, None] * stride_qh + i[None, :]
    x1 = tl.load(pq, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(pq + HALF, mask=mq, other=0.0).to(tl.float32)
    tl.store(pq, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mq)
    tl.store(pq + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mq)

    hk = tl.arange(0, KH_PAD)
    mk = (hk[:, None] < KH) & i_ok[None, :]
    pk = k_ptr + t * stride_kt + hk[:, None] * stride_kh + i[None, :]
    y1 = tl.load(pk, mask=mk, other=0.0).to(tl.float32)
    y2 = tl.load(pk + HALF, mask=mk, other=0.0).to(tl.float32)
    tl.store(pk, (y1 * cos - y2 * sin).to(k_ptr.dtype.element_ty), mask=mk)
    tl.store(pk + HALF, (y2 * cos + y1 * sin).to(k_ptr.dtype.element_ty), mask=mk)


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place (NeoX half-split layout) by the fp32
    cos/sin rows [max_position, D/2] of `positions` [T]; q and k may be strided views (of
    the fused qkv projection), their last dimension contiguous."""
    T, qh, d = q.shape
    kh = k.shape[1]
    if T == 0:
        return
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    half = d // 2
    _rotary_kernel[(T,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
                         QH=qh, KH=kh, HALF=half, QH_PAD=triton.next_power_of_2(qh),
                         KH_PAD=triton.next_power_of_2(kh), HALF_PAD=triton.next_power_of_2(half))  # fmt: skip
