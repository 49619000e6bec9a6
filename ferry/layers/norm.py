"""RMSNorm as a module: the fused kernels (layers/fused.py) behind the weight a checkpoint loads."""

from __future__ import annotations

import torch
from torch import nn

from ferry.layers.fused import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place), then normalise it (one fused pass on a GPU)."""
        return add_rms_norm(x, residual, self.weight, self.eps)
