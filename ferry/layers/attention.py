"""Reference paged attention in torch.

The batch is one flat list of tokens, decode requests (one query token each)
first, then prefill chunks. Every layer first writes the new K/V into the
paged cache through the slot mapping, then attends:
  - decode rows together: with the CPU kernel (fp32 queries, fp32 or bf16
    cache), straight from the blocks; otherwise their blocks are gathered with one index_select into
    [B, max_len] and masked by length;
  - each prefill chunk on its own: to its cached prefix (gathered from the
    cache) plus its own tokens, causally.
Because all writes of a layer happen before any read, a request may use
blocks that another request of the same step is filling (prefix sharing).

The cache of one layer is a pair of tensors [num_blocks, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk in the flat batch
    length: int  # query tokens in this chunk
    context_len: int  # tokens attended to: cached prefix + this chunk
    context_slots: torch.Tensor | None  # [context_len] cache slots, None when there is no prefix
    mask: torch.Tensor | None  # [length, context_len] bool, None when there is no prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64, tokens attended to
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size] bool (reference path)
    prefills: list[PrefillChunk] = field(default_factory=list)
    use_cpu_kernel: bool = False  # decode rows through ferry.kernels (CPU, fp32 model)


def cpu_decode_kernel_usable(device: torch.device, cache_dtype: torch.dtype) -> bool:
    if device.type != "cpu" or cache_dtype not in (torch.float32, torch.bfloat16):
        return False
    from ferry.kernels.cpu import cpu_kernels

    return cpu_kernels() is not None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H, D]."""
    num_blocks, block_size, kvh, d = k_cache.shape
    flat_k = k_cache.view(-1, kvh, d)
    flat_v = v_cache.view(-1, kvh, d)
    flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd and meta.use_cpu_kernel:
        from ferry.kernels.cpu import cpu_kernels

        out[:nd] = cpu_kernels().paged_decode_attention(
            q[:nd].contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale
        )
    elif nd:
        max_blocks = meta.decode_block_tables.shape[1]
        length = max_blocks * block_size
        ids = meta.decode_block_tables.reshape(-1)
        kd = k_cache.index_select(0, ids).view(nd, length, kvh, d).transpose(1, 2)
        vd = v_cache.index_select(0, ids).view(nd, length, kvh, d).transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[:nd] = o.squeeze(2)
    for chunk in meta.prefills:
        s, n = chunk.start, chunk.length
        qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.context_slots is None:
            kp = k[s : s + n].transpose(0, 1).unsqueeze(0)
            vp = v[s : s + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kp = flat_k.index_select(0, chunk.context_slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            vp = flat_v.index_select(0, chunk.context_slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[s : s + n] = o.squeeze(0).transpose(0, 1)
    return out
