"""The prefill chunks' whole contexts laid out back to back, for attention over K/V that a layer
computes from the cache rather than reads from it: multi-head latent attention (layers/mla.py)
expands its cached latent rows into per-head K/V for its prefill chunks.

Expanding chunk by chunk costs ~20 small ops per chunk and layer; a step of ten chunks on a GPU
spent most of its time launching them (BENCHMARKS.md, fourth lease: device busy 8% of a
DeepSeek-V2-Lite prefill step). Here the chunks' context rows are gathered in one index_select,
expanded by one GEMM, and attended in one call of a paged prefill kernel: each chunk's context
(its cached prefix, then itself) is padded to whole blocks and given consecutive blocks of the
layout, so `tables` are ranges and the kernels read the expanded K/V as they read a paged cache.
Contexts are taken in groups, so the expanded K/V of one call stay within what the engine's memory
profile saw or what one chunk alone needed before: at most the step's own rows (the profile runs a
step of max_num_batched_tokens rows, whose one chunk expands that many) or the longest context of the
step's chunks, whichever is more; a chunk longer than that is a group of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferry.layers.attention.metadata import AttentionMetadata, PrefillHost, padded_table

# Context rows expanded at once (per layer ~3 x rows x heads x (qk width) values of K, V and the
# kv_b_proj output): None, the bound above; an int overrides it (the tests).
EXPANDED_GROUP_ROWS: int | None = None


@dataclass
class ContextGroup:
    """Consecutive prefill chunks `first` .. `first + len(tables) - 1` of the step (meta.prefills)."""

    first: int
    slots: torch.Tensor  # [blocks * block_size] int64: the cache slot of each row of the layout
    tables: torch.Tensor  # [chunks, widest] int64: each chunk's blocks in the layout (padded with 0)
    spans: torch.Tensor  # [chunks, 3] int64 on the host: (first row in the flat batch, rows, context length)
    max_query_len: int
    rows: tuple[int, int]  # the flat batch's rows the group's chunks cover: [begin, end)


def _padded_rows(p: PrefillHost, block_size: int) -> int:
    """The rows chunk p's context takes in the layout: whole blocks."""
    return -(-p.context_len // block_size) * block_size


def _group(meta: AttentionMetadata, first: int, end: int, device: torch.device) -> ContextGroup:
    bs = meta.block_size
    chunks = meta.prefills[first:end]
    slots, tables, taken = [], [], 0
    for p in chunks:
        pos = np.arange(_padded_rows(p, bs))
        chunk_slots = p.block_ids[pos // bs] * bs + pos % bs
        # Rows past the context repeat its first one: real values the kernels mask, never stale ones.
        chunk_slots[p.context_len :] = chunk_slots[0]
        slots.append(chunk_slots)
        tables.append(np.arange(taken, taken + len(pos) // bs, dtype=np.int64))
        taken += len(pos) // bs
    return ContextGroup(
        first=first,
        slots=torch.from_numpy(np.concatenate(slots).astype(np.int64)).to(device, non_blocking=True),
        tables=torch.from_numpy(padded_table(tables)).to(device, non_blocking=True),
        spans=torch.tensor([(p.start, p.length, p.context_len) for p in chunks], dtype=torch.int64),
        max_query_len=max(p.length for p in chunks),
        rows=(chunks[0].start, chunks[-1].start + chunks[-1].length),
    )


def context_groups(meta: AttentionMetadata, device: torch.device, max_rows: int | None = None) -> list[ContextGroup]:
    """The step's prefill chunks in groups of consecutive chunks whose padded contexts fit `max_rows`
    (default EXPANDED_GROUP_ROWS, else the module's bound: the step's rows or its longest context)."""
    bs = meta.block_size
    if max_rows is None:
        max_rows = EXPANDED_GROUP_ROWS
    if max_rows is None:
        longest = max((_padded_rows(p, bs) for p in meta.prefills), default=0)
        max_rows = max(meta.slot_mapping.numel(), longest)
    groups, first, rows = [], 0, 0
    for i, p in enumerate(meta.prefills):
        padded = _padded_rows(p, bs)
        if i > first and rows + padded > max_rows:
            groups.append(_group(meta, first, i, device))
            first, rows = i, 0
        rows += padded
    if meta.prefills:
        groups.append(_group(meta, first, len(meta.prefills), device))
    return groups


def step_context_groups(meta: AttentionMetadata, device: torch.device) -> list[ContextGroup]:
    """context_groups, built once per step: kept in the backend's per-step state (`meta.state`, whose
    `context_groups` field starts as None) for the model's other layers."""
    if meta.state.context_groups is None:
        meta.state.context_groups = context_groups(meta, device)
    return meta.state.context_groups
