"""Residual add + RMSNorm, RMSNorm and SiLU-and-mul: Triton kernels on CUDA, one C++ call each
for fp32 on the CPU (ferry/kernels/csrc/fused_ops_cpu.cpp), torch elsewhere; GeGLU in torch.

The decoder carries its residual stream separately (vLLM's layout): each norm first adds
the sublayer's output to the residual, then normalises it, in one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.kernels.cpu import cpu_kernels


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def cpu_fused_kernels(*tensors: torch.Tensor):
    """The C++ kernels when every tensor is a contiguous fp32 CPU tensor (else None: torch)."""
    if all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return cpu_kernels()
    return None


def _heads_view(x: torch.Tensor) -> bool:
    """[T, H, D] heads viewed inside a fused qkv, each token's heads contiguous (the C++ rms_norm
    takes it as is: Qwen3's q/k norms)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    cpu_rows = x.device.type == "cpu" and x.dtype == torch.float32 and (x.is_contiguous() or _heads_view(x))
    kernels = cpu_fused_kernels(weight) if cpu_rows else None
    if kernels is not None:
        return kernels.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual) * weight."""
    if _use_triton(x):
        from ferry.kernels.triton_fused import add_rms_norm as kernel

        return kernel(x, residual, weight, eps)
    kernels = cpu_fused_kernels(x, residual, weight)
    if kernels is not None:
        return kernels.add_rms_norm_(x, residual, weight, eps)
    residual.add_(x)
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _use_triton(gate_up):
        from ferry.kernels.triton_fused import silu_and_mul as kernel

        return kernel(gate_up)
    kernels = cpu_fused_kernels(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate, tanh approximation) * up, in torch on every device."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """The gated MLP's activation by its ModelConfig.hidden_act name: silu or gelu_tanh."""
    return silu_and_mul(gate_up) if act == "silu" else gelu_tanh_and_mul(gate_up)
