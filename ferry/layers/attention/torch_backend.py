"""The reference backend in plain torch (the oracle for the others), with the CPU decode kernel.

- decode rows together: with the C++ CPU kernel (fp32 queries, fp32, bf16, int8 or fp8
  cache) straight from the blocks; otherwise their blocks are gathered with one index_select
  into [B, max_len] (dequantized when the cache is quantized) and masked by length;
- each prefill chunk on its own: SDPA over its cached prefix (gathered from the cache)
  plus its own tokens, causally. With a quantized cache the chunk's own tokens are read
  back from the cache too (what decode and the Triton kernels see). With the C++ kernels and
  fp32 queries, every chunk in one call of the prefill kernel instead, straight from the blocks
  (not for soft-capped layers), and the new K/V rows stored by `store_kv_rows` (the same bytes).

A layer may have a sliding window W (Mistral's every layer, Gemma's local ones): query position i
then attends to keys i - W < j <= i, as HF's sliding-window mask does. Only the window's blocks are
gathered (the cache manager may have freed the blocks before it, whose table entries then point at
a stand-in block); the masks and tables are built once per step and window (`WindowView`). With
`softcap` (Gemma 2) the scores go through softcap * tanh(scores / softcap) before the softmax. The
C++ decode kernel takes windowed rows as tables from the window's first block with the keys before
the window skipped there; soft-capped layers and windowed draft trees take SDPA.

Multi-head latent attention (layers/mla.py) runs on this backend only: one shared row per token
(`latent_decode` reads it for the absorbed decode; the layer expands the prefill chunks' rows,
`view(meta).chunks`, itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ferry.kv_quant import (
    KEYS,
    LAYOUT_IDS,
    QUANTIZED_KV_DTYPES,
    ROWS,
    VALUES,
    dequantize_rows,
    is_quantized,
    rows_at,
    rows_of_blocks,
    store_rows,
)
from ferry.layers.attention.contexts import ContextGroup
from ferry.layers.attention.metadata import AttentionMetadata, padded_table


@dataclass
class TorchChunk:
    start: int
    length: int
    context_slots: torch.Tensor | None  # [context_len] cache slots, None when there is no prefix
    mask: torch.Tensor | None  # [length, context_len] bool, None when there is no prefix


@dataclass
class WindowView:
    """What the step's rows attend to under one sliding window (None: the whole context)."""

    # [B, 1, 1, tables' width * block_size] bool, built when a decode path first asks (`decode_mask`):
    # the C++ kernel needs none.
    decode_mask: torch.Tensor | None = None
    first_pos: np.ndarray | None = None  # [B, 1]: each decode row's first position in its tables
    # Sliding window: each decode row's blocks from its window's first one (else the full tables), and
    # for the C++ kernel the lengths from that block and the keys before the window in it.
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_skip: torch.Tensor | None = None
    # The prefill chunks' contexts for the SDPA path and MLA, built when first asked for (the C++
    # prefill kernel reads the tables instead).
    chunks: list[TorchChunk] | None = None


@dataclass
class TorchState:
    use_cpu_kernel: bool  # the C++ decode and prefill kernels, for the layers without soft-capping
    views: dict[int | None, WindowView] = field(default_factory=dict)  # built when a layer first asks
    prefill_spans: torch.Tensor | None = None  # [C, 3] (first row, rows, context) for the prefill kernel
    context_groups: list[ContextGroup] | None = None  # MLA's expanded prefill, built when first asked for


def cpu_decode_kernel_usable(device: torch.device, cache_dtype: torch.dtype) -> bool:
    if device.type != "cpu" or cache_dtype not in (torch.float32, torch.bfloat16, *QUANTIZED_KV_DTYPES):
        return False
    from ferry.kernels.cpu import cpu_kernels

    return cpu_kernels() is not None


def attend(q, k, v, scale: float, softcap: float | None, mask: torch.Tensor | None = None, causal: bool = False):
    """Attention of q [..., H, M, D] over k, v [..., KVH, N, D] (GQA by repetition); `mask` bool
    (True: attended) broadcast to [..., H, M, N], or causal. With `softcap`, scores become
    softcap * tanh(scores / softcap) before the softmax (Gemma 2), which SDPA cannot do."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    s = softcap * torch.tanh(s / softcap)
    if causal:
        m, n = s.shape[-2:]
        mask = torch.ones(m, n, dtype=torch.bool, device=s.device).tril(n - m)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)


def prefill_chunks(meta: AttentionMetadata, window: int | None, device: torch.device) -> list[TorchChunk]:
    """Each prefill chunk's context: None for a whole prompt in one chunk (causal attention over its own
    rows), else the context's cache slots from the first key any of its queries sees, and the mask."""
    chunks, bs = [], meta.block_size
    for p in meta.prefills:
        begin = p.context_len - p.length
        if begin == 0 and (window is None or p.length <= window):
            chunks.append(TorchChunk(p.start, p.length, None, None))
            continue
        lo = 0 if window is None else max(0, begin - window + 1)  # the first query's first key
        ctx_pos = np.arange(lo, p.context_len, dtype=np.int64)
        ctx_slots = p.block_ids[ctx_pos // bs] * bs + ctx_pos % bs
        q_pos = np.arange(begin, p.context_len)[:, None]
        mask = ctx_pos[None, :] <= q_pos
        if window is not None:
            mask &= ctx_pos[None, :] > q_pos - window
        chunks.append(TorchChunk(p.start, p.length, torch.from_numpy(ctx_slots).to(device),
                                 torch.from_numpy(mask).to(device)))  # fmt: skip
    return chunks


def tree_positions(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray | None]:
    """Where a sliding window counts from in a step with a draft tree: each decode row's position + 1
    ([B]) and, per row, how many of the drafts it attends sit at or before each draft slot ([B, 64],
    None without a tree). A tree stores node j at slot first + j but places it (rotary) at position
    first + depth(j); its ancestors come before it in slot order, one per depth, so an attended
    draft key's position is first + (the drafts attended up to its slot). Without a tree, or for a
    row that is not a draft, a slot is its position."""
    if meta.decode_tree_host is None:
        return meta.decode_seq_lens_host, None
    start = meta.decode_tree_host[:, 0]
    bits = meta.decode_tree_host[:, 1].view(np.uint64)
    counts = np.cumsum((bits[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1), axis=1).astype(np.int64)
    return start + counts[:, -1], counts


class TorchAttentionBackend:
    name = "torch"
    supports_tree = True  # decode rows with an ancestor mask (tree verification)

    def __init__(self, device: torch.device, use_cpu_kernel: bool = False) -> None:
        self.device = device
        self.use_cpu_kernel = use_cpu_kernel
        self._latent_rows: torch.Tensor | None = None  # latent_decode's gather buffer

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.state = TorchState(use_cpu_kernel=self.use_cpu_kernel)
        if self.use_cpu_kernel and meta.prefills:
            spans = [(p.start, p.length, p.context_len) for p in meta.prefills]
            meta.state.prefill_spans = torch.tensor(spans, dtype=torch.int64)

    def view(self, meta: AttentionMetadata, window: int | None = None, with_chunks: bool = True) -> WindowView:
        """The decode tables and (`with_chunks`) the prefill chunks' contexts under `window`, built
        once per step and window (the decode mask on demand: `decode_mask`)."""
        state: TorchState = meta.state
        view = state.views.get(window)
        if view is None:
            view = state.views[window] = self._decode_view(meta, window)
        if with_chunks and view.chunks is None:
            view.chunks = prefill_chunks(meta, window, self.device)
        return view

    def _decode_view(self, meta: AttentionMetadata, window: int | None) -> WindowView:
        view = WindowView()
        bs = meta.block_size
        if meta.num_decodes and window is not None:  # gather from the block holding the window's first key on
            lo = np.maximum(tree_positions(meta)[0] - window, 0)
            first = lo // bs
            rows = [blocks[f:] for blocks, f in zip(meta.decode_blocks_host, first)]
            view.decode_tables = torch.from_numpy(padded_table(rows)).to(self.device)
            view.decode_lens = torch.from_numpy(meta.decode_seq_lens_host - first * bs).to(self.device)
            view.decode_skip = torch.from_numpy(lo - first * bs).to(self.device)
            view.first_pos = first[:, None] * bs
        return view

    def decode_mask(self, meta: AttentionMetadata, window: int | None = None) -> torch.Tensor:
        """[B, 1, 1, L] bool over the positions `view(meta, window)`'s decode tables hold: within each
        row's length (and window), and for a draft tree only its ancestors among the drafts."""
        view = self.view(meta, window)
        if view.decode_mask is not None:
            return view.decode_mask
        tables = meta.decode_block_tables if view.decode_tables is None else view.decode_tables
        pos = np.arange(tables.shape[1] * meta.block_size)[None, :]
        if view.first_pos is not None:
            pos = view.first_pos + pos
        lens = meta.decode_seq_lens_host[:, None]
        mask = pos < lens
        tree = meta.decode_tree_host
        if window is not None:  # by position, not slot: a draft tree's nodes sit at their depth
            row_end, counts = tree_positions(meta)
            key_pos = pos
            if counts is not None:
                start = tree[:, :1]
                offset = np.broadcast_to(np.clip(pos - start, 0, 63), (len(tree), pos.shape[1]))
                drafts_before = np.take_along_axis(counts, offset, axis=1)
                key_pos = np.where(pos < start, pos, start - 1 + drafts_before)
            mask &= key_pos >= row_end[:, None] - window
        if tree is not None:
            start, bits = tree[:, :1], tree[:, 1:].view(np.uint64)
            offset = np.clip(pos - start, 0, 63).astype(np.uint64)
            mask &= (pos < start) | ((bits >> offset) & np.uint64(1)).astype(bool)
        view.decode_mask = torch.from_numpy(mask[:, None, None, :]).to(self.device)
        return view.decode_mask

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        num_blocks, block_size, kvh, w = k_cache.shape
        state: TorchState = meta.state
        if state.use_cpu_kernel and k.dtype == torch.float32:  # the same bytes in one pass a row
            from ferry.kernels.cpu import cpu_kernels

            cpu_kernels().store_kv_rows(k_cache, meta.slot_mapping, k, LAYOUT_IDS[KEYS])
            cpu_kernels().store_kv_rows(v_cache, meta.slot_mapping, v, LAYOUT_IDS[VALUES])
        else:
            store_rows(k_cache, meta.slot_mapping, k, KEYS)
            store_rows(v_cache, meta.slot_mapping, v, VALUES)
        quantized = is_quantized(k_cache.dtype)

        def read(rows: torch.Tensor) -> torch.Tensor:
            """Gathered cache rows as q's dtype (dequantized when the cache is quantized)."""
            return dequantize_rows(rows, q.dtype) if quantized else rows.to(q.dtype)

        # The C++ prefill kernel takes every chunk in one call, straight from the cache; the SDPA
        # path (soft-capping, non-fp32 queries, no kernels) gathers each chunk's context.
        prefill_kernel = state.prefill_spans is not None and softcap is None and q.dtype == torch.float32
        view = self.view(meta, window, with_chunks=not prefill_kernel)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        windowed_kernel = window is not None and meta.decode_tree is None  # (no window with a draft tree)
        if nd and state.use_cpu_kernel and softcap is None and (window is None or windowed_kernel):
            from ferry.kernels.cpu import cpu_kernels

            if window is None:
                tables, lens, skip = meta.decode_block_tables, meta.decode_seq_lens, None
            else:  # the tables from the window's first block, the keys before the window skipped there
                tables, lens, skip = view.decode_tables, view.decode_lens, view.decode_skip
            out[:nd] = cpu_kernels().paged_decode_attention(
                q[:nd].contiguous(), k_cache, v_cache, tables, lens, scale, meta.decode_tree, skip
            )
        elif nd:
            tables = meta.decode_block_tables if view.decode_tables is None else view.decode_tables
            length = tables.shape[1] * block_size
            ids = tables.reshape(-1)
            kd = read(rows_of_blocks(k_cache.index_select(0, ids), KEYS)).view(nd, length, kvh, -1).transpose(1, 2)
            vd = read(rows_of_blocks(v_cache.index_select(0, ids), VALUES)).view(nd, length, kvh, -1).transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
            out[:nd] = attend(qd, kd, vd, scale, softcap, mask=self.decode_mask(meta, window)).squeeze(2)
        if prefill_kernel:
            from ferry.kernels.cpu import cpu_kernels

            cpu_kernels().paged_prefill_attention(q.contiguous(), k_cache, v_cache, meta.prefill_block_tables,
                                                  state.prefill_spans, scale, window or 0, out)  # fmt: skip
            return out
        for chunk in view.chunks:
            s, n = chunk.start, chunk.length
            qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if chunk.context_slots is None and not quantized:
                kp = k[s : s + n].transpose(0, 1).unsqueeze(0)
                vp = v[s : s + n].transpose(0, 1).unsqueeze(0)
                o = attend(qp, kp, vp, scale, softcap, causal=True)
            elif chunk.context_slots is None:
                # A quantized cache: attend to the stored (quantized) rows, as decode and the Triton
                # prefill do, so a prompt's logits see the same K/V its continuation will.
                slots = meta.slot_mapping[s : s + n]
                kp = read(rows_at(k_cache, slots, KEYS)).transpose(0, 1).unsqueeze(0)
                vp = read(rows_at(v_cache, slots, VALUES)).transpose(0, 1).unsqueeze(0)
                o = attend(qp, kp, vp, scale, softcap, causal=True)
            else:
                kp = read(rows_at(k_cache, chunk.context_slots, KEYS)).transpose(0, 1).unsqueeze(0)
                vp = read(rows_at(v_cache, chunk.context_slots, VALUES)).transpose(0, 1).unsqueeze(0)
                o = attend(qp, kp, vp, scale, softcap, mask=chunk.mask)
            out[s : s + n] = o.squeeze(0).transpose(0, 1)
        return out

    def attends_contexts(self, dtype: torch.dtype) -> bool:
        """Whether `attend_contexts` takes queries of `dtype`: the C++ prefill kernel's fp32 on the CPU."""
        return dtype == torch.float32 and cpu_decode_kernel_usable(self.device, dtype)

    def attend_contexts(self, q, k, v, group: ContextGroup, meta: AttentionMetadata, scale: float, out) -> None:
        """The group's chunks' rows of q [T, H, D] attend causally over K/V [blocks, block_size, H, D] laid
        out as `group` says (layers/attention/contexts.py), in one call of the C++ prefill kernel, into
        the same rows of out [T, H, D] (contiguous); its other rows are left as they are."""
        from ferry.kernels.cpu import cpu_kernels

        cpu_kernels().paged_prefill_attention(q.contiguous(), k, v, group.tables, group.spans, scale, 0, out)

    def store_latent(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """MLA's rows [T, W] (latent then rotary key) into the one-head cache at `slots`."""
        store_rows(cache, slots, rows.unsqueeze(1), ROWS)

    def latent_decode(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      v_width: int) -> torch.Tensor:  # fmt: skip
        """MLA's absorbed decode: the decode rows' queries q [B, H, D] all attend to one shared row per
        token of `cache` (the latent then the rotary key, D wide), whose first `v_width` values are
        also the value. Returns [B, H, v_width]. The rows are already stored.

        The heads are one KV head's query rows, so each row is gathered once and read by every head
        (no copy per head), with two batched matmuls; the gathered rows go into a buffer kept across
        layers and steps (a fresh one of this size costs more in page faults than the copy itself)."""
        nd, block_size = meta.num_decodes, cache.shape[1]
        mask = self.decode_mask(meta)
        tables = meta.decode_block_tables
        length = tables.shape[1] * block_size
        ids = tables.reshape(-1)
        if self._latent_rows is None or self._latent_rows.numel() < ids.numel() * cache[0].numel() \
                or self._latent_rows.dtype != cache.dtype or self._latent_rows.device != cache.device:  # fmt: skip
            self._latent_rows = torch.empty(ids.numel() * cache[0].numel(), dtype=cache.dtype, device=cache.device)
        rows = self._latent_rows[: ids.numel() * cache[0].numel()].view(ids.numel(), *cache.shape[1:])
        torch.index_select(cache, 0, ids, out=rows)
        rows = dequantize_rows(rows, q.dtype) if is_quantized(cache.dtype) else rows.to(q.dtype)
        rows = rows.view(nd, length, -1)  # [B, L, D]
        scores = torch.bmm(q * scale, rows.transpose(1, 2))  # [B, H, L]
        scores.masked_fill_(~mask.view(nd, 1, length), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, rows[..., :v_width])
