"""What every attention backend gets for one step: where new K/V go and what each row attends to.

The batch is one flat list of tokens: decode requests (one query token each) first, then
prefill chunks. Every layer first writes the new K/V into the paged cache through the
slot mapping, then attends; because all writes of a layer happen before any read, a
request may use blocks that another request of the same step is filling (prefix sharing).

The runner fills the common fields once per step (`build_metadata`); the backend's
`prepare` then adds what it needs (`state`) before the first layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


@dataclass
class PrefillHost:
    """One prefill chunk, on the host."""

    start: int  # offset of the chunk in the flat batch
    length: int  # query tokens in this chunk
    context_len: int  # tokens attended to: cached prefix + this chunk
    block_ids: np.ndarray  # the request's blocks covering its context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes (-1: nowhere)
    block_size: int
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64, tokens attended to
    decode_seq_lens_host: np.ndarray | None = None
    decode_blocks_host: list[np.ndarray] = field(default_factory=list)
    # Tree verification: per decode row (start, bits); of the positions in [start, seq_len) only those
    # whose bit p - start is set are attended (a draft's ancestors and itself, not its cousins), read
    # as consecutive positions from start by the C++ kernel (bit for bit a plain row). None: no tree.
    decode_tree: torch.Tensor | None = None  # [num_decodes, 2] int64
    decode_tree_host: np.ndarray | None = None
    prefills: list[PrefillHost] = field(default_factory=list)
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_blocks] int64
    prefill_query_start_loc: torch.Tensor | None = None  # [num_prefills + 1] rows of the flat batch
    prefill_seq_lens: torch.Tensor | None = None  # [num_prefills] context lengths
    max_prefill_len: int = 0
    backend: AttentionBackend | None = None
    state: Any = None  # the backend's own per-step data

    @property
    def num_prefills(self) -> int:
        return len(self.prefills)


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Once per step, after the common fields are set: build `meta.state`."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Store k/v ([T, KVH, D]) through the slot mapping, then attend; q: [T, H, D] -> [T, H, D].
        `window`: the layer's sliding window; `softcap`: its attention logits soft-capped."""


def padded_table(rows: list[np.ndarray]) -> np.ndarray:
    """Rows of block ids as one [len(rows), longest] table, padded with block 0."""
    width = max((len(r) for r in rows), default=0)
    table = np.zeros((len(rows), max(width, 1)), dtype=np.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table


def build_metadata(
    *,
    slot_mapping: np.ndarray,
    block_size: int,
    decode_blocks: list[np.ndarray],
    decode_seq_lens: np.ndarray,
    prefills: list[PrefillHost],
    device: torch.device,
    backend: AttentionBackend,
    decode_tree: np.ndarray | None = None,
) -> AttentionMetadata:
    """Copy the step's tables to the device once and let the backend prepare."""
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device, non_blocking=True), block_size=block_size
    )
    nd = len(decode_blocks)
    if nd:
        meta.num_decodes = nd
        meta.decode_block_tables = torch.from_numpy(padded_table(decode_blocks)).to(device, non_blocking=True)
        meta.decode_seq_lens = torch.from_numpy(decode_seq_lens).to(device, non_blocking=True)
        meta.decode_seq_lens_host = decode_seq_lens
        meta.decode_blocks_host = decode_blocks
        if decode_tree is not None:
            if not getattr(backend, "supports_tree", False):
                raise ValueError(f"the {backend.name} attention backend cannot verify draft trees")
            meta.decode_tree = torch.from_numpy(decode_tree).to(device, non_blocking=True)
            meta.decode_tree_host = decode_tree
    if prefills:
        meta.prefills = prefills
        starts = np.array([p.start for p in prefills] + [prefills[-1].start + prefills[-1].length], dtype=np.int64)
        meta.prefill_query_start_loc = torch.from_numpy(starts).to(device, non_blocking=True)
        lens = np.array([p.context_len for p in prefills], dtype=np.int64)
        meta.prefill_seq_lens = torch.from_numpy(lens).to(device, non_blocking=True)
        tables = [p.block_ids[: -(-p.context_len // block_size)] for p in prefills]
        meta.prefill_block_tables = torch.from_numpy(padded_table(tables)).to(device, non_blocking=True)
        meta.max_prefill_len = max(p.length for p in prefills)
    meta.backend = backend
    backend.prepare(meta)
    return meta
