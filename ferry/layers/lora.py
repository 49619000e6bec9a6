"""LoRA adapters served beside the base weights (multi-LoRA batching, as vLLM's punica kernels do).

An adapter adds `scale · B(A x)` to a linear layer's output, A [r, in] and B [out, r] of small rank
r. The base weight is never changed, so one batch mixes requests of several adapters and of none:
each step names, per row, the adapter slot it runs under (`LoRABatch`), and every adapted layer
gathers the rows of each slot, runs their two thin matmuls, and adds the result into those rows
(one gather and one `index_add_` per adapter in the step, never per request).

A fused layer (q/k/v, gate/up) holds one adapter part per projection; they are stacked into one A
(their ranks side by side) and one B that is block-diagonal over the output rows, so the fused
layer still runs one pair of matmuls. Ranks adapted nowhere cost nothing: a layer an adapter does
not target has no entry for its slot.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch


@dataclass
class LoRADelta:
    """One adapter's update of one layer: y += (x @ a.T) @ b.T, the scale folded into b."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]


class LoRABatch:
    """Which rows of the step run under which adapter slot: (slot, row indices) per slot present;
    None for the rows when one adapter has every row (no gather, no scatter)."""

    def __init__(self, groups: list[tuple[int, torch.Tensor | None]]) -> None:
        self.groups = groups

    @classmethod
    def from_slots(cls, slots: np.ndarray, device: torch.device) -> LoRABatch | None:
        """`slots`: per row, its adapter slot, -1 for none; None when no row has one."""
        present = np.unique(slots[slots >= 0])
        if not len(present):
            return None
        if len(present) == 1 and present[0] >= 0 and (slots == present[0]).all():
            return cls([(int(present[0]), None)])
        groups = [(int(s), torch.from_numpy(np.flatnonzero(slots == s)).to(device)) for s in present]
        return cls(groups)


_active: LoRABatch | None = None


@contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    """The adapters of the forward pass run inside (None: the base model alone)."""
    global _active
    outer, _active = _active, batch
    try:
        yield
    finally:
        _active = outer


def lora_active() -> bool:
    """Whether the forward pass running now has rows under an adapter (then the fused C++ decode
    step and CUDA graphs, which know nothing of adapters, are not used)."""
    return _active is not None


def add_lora(deltas: dict[int, LoRADelta], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y plus each adapter's update on its own rows (x: [T, in], y: [T, out], rows aligned)."""
    batch = _active
    if batch is None:
        return y
    y = y.contiguous()  # (the base paths' outputs are; a copy otherwise, so the update is never lost)
    x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    for slot, rows in batch.groups:
        d = deltas.get(slot)
        if d is None:
            continue
        if rows is None:
            y2.add_(((x2.to(d.a.dtype) @ d.a.T) @ d.b.T).to(y2.dtype))
            continue
        xs = x2.index_select(0, rows).to(d.a.dtype)
        y2.index_add_(0, rows, ((xs @ d.a.T) @ d.b.T).to(y2.dtype))
    return y


def fuse_parts(parts: list[tuple[int, LoRADelta]], out_features: int) -> LoRADelta:
    """One delta for a fused layer from its parts' deltas, each at its first output row: A stacked
    by rank, B block-diagonal (each part's rows get only its own rank's columns)."""
    a = torch.cat([d.a for _, d in parts])
    b = torch.zeros(out_features, a.shape[0], dtype=a.dtype, device=a.device)
    col = 0
    for row, d in parts:
        rows, rank = d.b.shape
        b[row : row + rows, col : col + rank] = d.b
        col += rank
    return LoRADelta(a, b)
