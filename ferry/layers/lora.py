"""LoRA adapters served beside the base weights (multi-LoRA batching, as vLLM's punica kernels do).

An adapter adds `scale · B(A x)` to a linear layer's output, A [r, in] and B [out, r] of small rank
r. The base weight is never changed, so one batch mixes requests of several adapters and of none:
each step names, per row, the adapter slot it runs under (`LoRABatch`), and every adapted layer
gathers the rows of each slot, runs their two thin matmuls, and adds the result into those rows
(one gather and one `index_add_` per adapter in the step, never per request). While the ranks of all
the adapters a layer holds add up to little (`STACKED_MAX_RANK`), a step mixing adapters instead runs
them all stacked: x times every adapter's A at once, each row's product masked to its own adapter's
columns, times every B at once: two matmuls whatever the number of adapters, each as thin as the
ranks together.

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


# The most rank, all adapters of a layer together, run stacked in a step mixing adapters: below it the
# stacked matmuls cost less than a gather, two matmuls and a scatter per adapter (`ferry bench lora`).
STACKED_MAX_RANK = 256


class LoRABatch:
    """Which rows of the step run under which adapter slot: (slot, row indices) per slot present;
    None for the rows when one adapter has every row (no gather, no scatter). `row_slots`: each
    row's slot (-1: none), for the stacked path."""

    def __init__(self, groups: list[tuple[int, torch.Tensor | None]], row_slots: torch.Tensor | None = None) -> None:
        self.groups = groups
        self.row_slots = row_slots

    @classmethod
    def from_slots(cls, slots: np.ndarray, device: torch.device) -> LoRABatch | None:
        """`slots`: per row, its adapter slot, -1 for none; None when no row has one."""
        present = np.unique(slots[slots >= 0])
        if not len(present):
            return None
        if len(present) == 1 and (slots == present[0]).all():
            return cls([(int(present[0]), None)])
        groups = [(int(s), torch.from_numpy(np.flatnonzero(slots == s)).to(device)) for s in present]
        return cls(groups, torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(device))


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


class LayerLoRA:
    """A layer's adapters: per slot its update, and all of them stacked (built when first needed)."""

    def __init__(self) -> None:
        self.deltas: dict[int, LoRADelta] = {}
        self._stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __bool__(self) -> bool:
        return bool(self.deltas)

    def set(self, slot: int, delta: LoRADelta) -> None:
        self.deltas[slot] = delta
        self._restack()

    def remove(self, slot: int) -> None:
        self.deltas.pop(slot, None)
        self._restack()

    def _restack(self) -> None:
        """While the ranks together stay within STACKED_MAX_RANK: every adapter's A stacked [sum r, in],
        B side by side [out, sum r], each column's slot; each adapter's own A and B become views of
        them (one copy of the weights, made when the adapter is attached, before the KV cache is sized)."""
        self._stacked = None
        slots = sorted(self.deltas)
        if not slots or sum(self.deltas[s].a.shape[0] for s in slots) > STACKED_MAX_RANK:
            return
        a = torch.cat([self.deltas[s].a for s in slots])
        b = torch.cat([self.deltas[s].b for s in slots], dim=1)
        col = torch.cat([torch.full((self.deltas[s].a.shape[0],), s, dtype=torch.int64) for s in slots])
        start = 0
        for s in slots:
            rank = self.deltas[s].a.shape[0]
            self.deltas[s] = LoRADelta(a[start : start + rank], b[:, start : start + rank])
            start += rank
        self._stacked = (a, b, col.to(a.device))

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each adapter's update on its own rows (x: [T, in], y: [T, out], rows aligned)."""
        batch = _active
        if batch is None:
            return y
        y = y.contiguous()  # (the base paths' outputs are; a copy otherwise, so the update is never lost)
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if batch.row_slots is not None and self._stacked is not None:
            a, b, col = self._stacked
            mask = (batch.row_slots[:, None] == col[None, :]).to(a.dtype)  # a row: its own adapter's ranks
            y2.add_((((x2.to(a.dtype) @ a.T) * mask) @ b.T).to(y2.dtype))
            return y
        for slot, rows in batch.groups:
            d = self.deltas.get(slot)
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
