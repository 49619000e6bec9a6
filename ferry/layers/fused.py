"""Residual add + RMSNorm and SiLU-and-mul: Triton kernels on CUDA, torch elsewhere.

The decoder carries its residual stream separately (vLLM's layout): each norm first adds
the sublayer's output to the residual, then normalises it, in one pass on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual) * weight."""
    if _use_triton(x):
        from ferry.kernels.triton_fused import add_rms_norm as kernel

        return kernel(x, residual, weight, eps)
    residual.add_(x)
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _use_triton(gate_up):
        from ferry.kernels.triton_fused import silu_and_mul as kernel

        return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
