"""Multi-head latent attention's absorbed decode in Triton (DeepSeek-V2/V3, layers/mla.py).

An MLA layer caches one row per token: the compressed latent c (kv_lora_rank values) then the
decoupled rotary key k_pe (qk_rope_head_dim), shared by every head. In the absorbed form each head's
query is [q_latent, q_pe] (its no-rope query already projected into the latent space), its score
against a token is q_latent . c + q_pe . k_pe, and its output is the softmax-weighted sum of the
tokens' latents c (the value is the latent itself; W_UV is applied afterwards, outside).

`paged_latent_decode`: one program per (request, block of 16 heads, split of the context). Each
tile of cached rows is read once and serves both dots and the value product for all the block's
heads (the point of MLA: one row per token instead of a K and V per head). Splits are merged by
triton_attention's merge kernel, as the split-KV decode does; the launch's shape depends on the
batch size only, so CUDA graphs capture it. A quantized cache (int8 / fp8 rows, each followed by its
fp32 scale: ferry/kv_quant.py) is widened in the loop, its scale multiplying the scores' columns
and folding into the probabilities. On the CPU it runs under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.triton_attention import (
    _INTERPRETED,
    _check_block_n,
    _dot,
    _merge_splits_kernel,
    _pow2,
    _precision,
    _quant,
    _scales,
)

HEADS_PER_PROGRAM = 16  # tl.dot's smallest M on GPUs: the heads of a program are the rows of its tiles


@triton.jit
def _latent_decode_kernel(
    q_ptr,
    cache_ptr,
    scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HEADS
    r = tl.arange(0, RANK_PAD)
    r_ok = r < RANK
    e = tl.arange(0, ROPE_PAD)
    e_ok = e < ROPE
    q_rows = q_ptr + seq * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_rows + RANK + e[None, :], mask=h_ok[:, None] & e_ok[None, :], other=0.0)
    if not QUANT:  # a quantized cache is widened to q's dtype instead (int8 and e4m3 are exact in bf16)
        q_lat = q_lat.to(cache_ptr.dtype.element_ty)
        q_pe = q_pe.to(cache_ptr.dtype.element_ty)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        c = tl.load(cache_ptr + row[:, None] + r[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(cache_ptr + row[:, None] + RANK + e[None, :], mask=valid[:, None] & e_ok[None, :], other=0.0)
        if QUANT:
            sc = tl.load(scale_ptr + row // 4 + (RANK + ROPE) // 4, mask=valid, other=0.0)
            c = c.to(q_lat.dtype)
            s = _dot(q_lat, tl.trans(c), PRECISION, DOT_F32) + _dot(q_pe, tl.trans(k_pe.to(q_pe.dtype)), PRECISION,
                                                                     DOT_F32)  # fmt: skip
            s = s * (sc * scale)[None, :]
        else:
            s = (_dot(q_lat, tl.trans(c), PRECISION, DOT_F32) + _dot(q_pe, tl.trans(k_pe), PRECISION, DOT_F32)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if QUANT:  # the row's scale folds into the probabilities: p @ (diag(sc) c) = (p * sc) @ c
            pv = _dot((p * sc[None, :]).to(c.dtype), c, PRECISION, DOT_F32)
        else:
            pv = _dot(p.to(c.dtype), c, PRECISION, DOT_F32)
        acc = acc * alpha[:, None] + pv
        m = m_new

    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + r[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])
    else:  # partial results [seq, head, split, RANK_PAD] and their log-sum-exp (-inf: an empty split)
        part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * RANK_PAD + r[None, :], out, mask=h_ok[:, None])
        lse = tl.where(l_sum > 0, m + tl.log(tl.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_ok)


def head_blocks(num_heads: int) -> int:
    """Programs per request and split: the heads in blocks of HEADS_PER_PROGRAM."""
    return triton.cdiv(num_heads, HEADS_PER_PROGRAM)


def paged_latent_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    rank: int,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    """One query token per request. q: [B, H, rank + rope] (absorbed queries); cache [num_blocks,
    block_size, 1, rank + rope] (+ 4 bytes of scale per row when quantized), the rows already
    stored; block_tables [B, max_blocks]; seq_lens [B] (0: a padding row, which gets zeros).
    Returns [B, H, rank]: each head's softmax-weighted sum of the latents, in q's dtype."""
    _check_block_n(block_n)
    B, H, width = q.shape
    _, block_size, kvh, _ = cache.shape
    rope = width - rank
    if kvh != 1 or rope <= 0:
        raise ValueError(f"a latent cache holds one row of rank + rope values per token, got {tuple(cache.shape)}")
    if out is None:
        out = torch.empty(B, H, rank, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    rank_pad, rope_pad = max(16, _pow2(rank)), max(16, _pow2(rope))
    if num_splits > 1:
        part_out = torch.empty(B * H * num_splits, rank_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B * H * num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    quant = _quant(cache)
    _latent_decode_kernel[(B, head_blocks(H), num_splits)](
        q, cache, _scales(cache), block_tables, seq_lens, out, part_out, part_lse, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        cache.stride(0), cache.stride(1),
        NUM_HEADS=H, BLOCK_H=HEADS_PER_PROGRAM, RANK=rank, RANK_PAD=rank_pad, ROPE=rope, ROPE_PAD=rope_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        PRECISION=_precision(q.dtype if quant else cache.dtype), DOT_F32=_INTERPRETED, QUANT=quant,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(B, H)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            D=rank, D_PAD=rank_pad, NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits), NUM_HEADS=H,
        )  # fmt: skip
    return out
