"""Paged attention in Triton: store, split-KV decode, varlen prefill.

The cache of one layer is a pair of tensors [num_blocks, block_size, kv_heads, head_dim]
(K and V); a token's slot is block * block_size + offset. Every kernel finds a
position's block through the request's block table, so any block size works.

- `store_kv`: one program per new token writes its K/V (all heads) into its slot;
  slot -1 writes nothing (CUDA-graph padding).
- `paged_decode`: one program per (request, KV head, split). All query heads of the KV
  group are the rows of one tile (GQA: each K/V tile is read once per group, and the
  group is padded to 16 rows for `tl.dot`). A request's context is cut into
  `num_splits` ranges, each reduced with an online softmax to a partial output and its
  log-sum-exp; a second kernel merges the splits (split-KV / FlashDecoding), so a
  small batch of long contexts still fills the GPU.
- `paged_prefill`: one program per (chunk, tile of query tokens, KV head), FlashAttention-
  style over the chunk's whole context read from the cache (the cached prefix plus the
  chunk itself, which `store_kv` wrote first), causal by absolute position. Rows of the
  tile are (token, head-of-group) pairs, so GQA again reads K/V once per group.

Both take a sliding window (only the last WINDOW positions up to a query's own are read: a
decode split covers the window, a prefill tile starts at its first token's window) and Gemma 2's
logit soft-capping, as compile-time constants (a model has at most two kinds of layer).

Scores and softmax run in fp32; `tl.dot` takes the cache dtype (bf16/fp16 on tensor
cores) and full fp32 precision (no TF32) when the cache is fp32. A quantized cache (int8 or
fp8 e4m3 rows and their fp32 scales, each block laid out by head: ferry/kv_quant.py) is quantized by
`store_kv` and widened to q's dtype in the loops (exact in bf16); K's scales multiply the
scores' columns, V's fold into the probabilities before the second dot. On the CPU the
kernels run under TRITON_INTERPRET=1 (the tests compare them with the torch backend).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ferry.kernels.triton_compat import apply_interpreter_numpy_fix
from ferry.kv_quant import qmax

apply_interpreter_numpy_fix()


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# Triton 3.6's interpreter multiplies the raw bits of 16-bit floats in tl.dot; there, dots
# take fp32 copies of the (already rounded) operands, which is the same arithmetic.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _soft_cap(s, SOFTCAP: tl.constexpr):
    """softcap * tanh(s / softcap) (Gemma 2's attention logits), tanh written with exp: saturates to
    +-softcap without overflow (exp(2x) -> inf gives 1, -> 0 gives -1)."""
    if SOFTCAP > 0:
        s = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP) + 1.0))
    return s


@triton.jit
def _round_e4m3(y):
    """y (|y| <= 448) rounded to the nearest e4m3 value (ties to even) in fp32 arithmetic, so the
    conversion that follows is exact: Triton 3.6's interpreter loses the carry when rounding up
    crosses a power of two (124.5 -> 64), and this keeps the GPU on the same, tested path."""
    e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # e4m3: 3 mantissa bits, min exp -6
    inv_ulp = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2 ** (3 - e)
    ulp = ((124 + e) << 23).to(tl.float32, bitcast=True)  # 2 ** (e - 3)
    r = y * inv_ulp  # |r| < 16: adding 1.5 * 2**23 rounds it to an integer, ties to even
    return ((r + 12582912.0) - 12582912.0) * ulp


@triton.jit
def _quantize_rows(x, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """Rows of x [rows, D_PAD] (padding zeros) -> (values to store, fp32 scale per row): symmetric,
    scale = absmax / QMAX; int8 rounds half away from zero (as kv_quant.quantize_rows), fp8 to nearest."""
    x = x.to(tl.float32)
    sc = tl.maximum(tl.max(tl.abs(x), 1), 1e-30) / QMAX
    y = x / sc[:, None]
    if QUANT == 1:
        y = tl.minimum(tl.maximum(tl.where(y >= 0, y + 0.5, y - 0.5), -127.0), 127.0)
    else:
        y = _round_e4m3(tl.minimum(tl.maximum(y, -QMAX), QMAX))
    return y, sc


@triton.jit
def _kv_offsets(block, t, kvh, d, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                QUANT: tl.constexpr):  # fmt: skip
    """Element offsets of tokens (block, t)'s values d of kv head kvh: K's and V's [N, D_PAD], and the
    rows' scales' [N] (in the cache seen as fp32). A float cache's rows are [BS][KVH][D]; a quantized
    one's blocks are laid out by head (kv_quant.py): head h's part is BLOCK_SIZE rows' bytes, K's values
    [D/2][BLOCK_SIZE][2] or V's [BLOCK_SIZE/2][D][2], then BLOCK_SIZE fp32 scales."""
    if QUANT:
        head = block * stride_cb + kvh * (BLOCK_SIZE * stride_ch)
        k_off = head[:, None] + ((d[None, :] // 2) * BLOCK_SIZE + t[:, None]) * 2 + d[None, :] % 2
        v_off = head[:, None] + ((t[:, None] // 2) * D + d[None, :]) * 2 + t[:, None] % 2
        sc_off = (head + D * BLOCK_SIZE) // 4 + t
    else:
        row = block * stride_cb + t * stride_cs + kvh * stride_ch
        k_off = row[:, None] + d[None, :]
        v_off = k_off
        sc_off = row
    return k_off, v_off, sc_off


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    KVH: tl.constexpr,
    D: tl.constexpr,
    KVH_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    HAS_V: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, KVH_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < KVH) & (d[None, :] < D) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    row = slot * stride_cs + h * stride_ch
    dst = row[:, None] + d[None, :]
    h_ok = (h < KVH) & (slot >= 0)
    # A quantized K/V cache's blocks are laid out by head (kv_quant.py): head h's part of a block is
    # BLOCK_SIZE rows' bytes, K's values [D/2][BLOCK_SIZE][2] or V's [BLOCK_SIZE/2][D][2], then the
    # BLOCK_SIZE fp32 scales (its byte offset a multiple of 4). MLA's latent cache (no V) stays rows:
    # D values, then the scale (element D // 4 of the row seen as fp32).
    tt = slot % BLOCK_SIZE
    head = (slot // BLOCK_SIZE) * (BLOCK_SIZE * stride_cs) + h * (BLOCK_SIZE * stride_ch)
    scale_at = (head + D * BLOCK_SIZE) // 4 + tt
    if QUANT:
        k, k_sc = _quantize_rows(k, QUANT, QMAX)
        if HAS_V:
            tl.store(k_scale_ptr + scale_at, k_sc, mask=h_ok)
            dst = head[:, None] + ((d[None, :] // 2) * BLOCK_SIZE + tt) * 2 + d[None, :] % 2
        else:
            tl.store(k_scale_ptr + row // 4 + D // 4, k_sc, mask=h_ok)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if HAS_V:
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        if QUANT:
            v, v_sc = _quantize_rows(v, QUANT, QMAX)
            tl.store(v_scale_ptr + scale_at, v_sc, mask=h_ok)
            dst = head[:, None] + ((tt // 2) * D + d[None, :]) * 2 + tt % 2
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _quant(cache: torch.Tensor) -> int:
    """The kernels' QUANT constant: 0 a float cache, 1 int8, 2 fp8 e4m3 (values + scales, kv_quant.py)."""
    return {torch.int8: 1, torch.float8_e4m3fn: 2}.get(cache.dtype, 0)


def _scales(cache: torch.Tensor) -> torch.Tensor:
    """A quantized cache seen as fp32 (where the kernels read the rows' scales); itself otherwise."""
    return cache.view(torch.float32) if _quant(cache) else cache


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, KVH, D]; caches [num_blocks, block_size, KVH, D] (D + 4 when quantized: each row's
    values are quantized on the write and its scale stored after them); slot_mapping [T] (-1: skip).
    v and v_cache None: one cache only (MLA's latent rows)."""
    T, kvh, d = k.shape
    if T == 0:
        return
    has_v = v is not None
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = (v if v.stride(-1) == 1 else v.contiguous()) if has_v else k
    v_cache = v_cache if has_v else k_cache
    quant = _quant(k_cache)
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, _scales(k_cache), _scales(v_cache), slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        KVH=kvh, D=d, KVH_PAD=_pow2(kvh), D_PAD=_pow2(d), QUANT=quant, QMAX=qmax(k_cache.dtype) if quant else 1.0,
        HAS_V=has_v, BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    stride_ch,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    QUANT: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if WINDOW > 0:  # the query (position seq_len - 1) sees the last WINDOW keys; blocks before may be freed
        lo = tl.maximum(seq_len - WINDOW, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    d_ok = d < D
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
    )
    if not QUANT:  # a quantized cache is widened to q's dtype instead (int8 and e4m3 are exact in bf16)
        q = q.to(k_cache_ptr.dtype.element_ty)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        k_off, v_off, sc_off = _kv_offsets(block, pos % BLOCK_SIZE, kvh, d, stride_cb, stride_cs, stride_ch,
                                           BLOCK_SIZE, D, QUANT)  # fmt: skip
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=kv_mask, other=0.0)
        if QUANT:
            k_sc = tl.load(k_scale_ptr + sc_off, mask=valid, other=0.0)
            s = _dot(q, tl.trans(k.to(q.dtype)), PRECISION, DOT_F32) * (k_sc * scale)[None, :]
        else:
            s = _dot(q, tl.trans(k), PRECISION, DOT_F32) * scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], _soft_cap(s, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + v_off, mask=kv_mask, other=0.0)
        if QUANT:  # V's scales fold into the probabilities: p @ (diag(sc) v) = (p * sc) @ v
            v_sc = tl.load(v_scale_ptr + sc_off, mask=valid, other=0.0)
            pv = _dot((p * v_sc[None, :]).to(q.dtype), v.to(q.dtype), PRECISION, DOT_F32)
        else:
            pv = _dot(p.to(v.dtype), v, PRECISION, DOT_F32)
        acc = acc * alpha[:, None] + pv
        m = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        # Partial results [seq, head, split, D] (normalized) and their log-sum-exp (-inf: empty split).
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * D_PAD + d[None, :], out, mask=g_ok[:, None])
        lse = tl.where(l_sum > 0, m + tl.log(tl.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    NUM_HEADS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + sp
    lse = tl.load(part_lse_ptr + row, mask=sp < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty context (padding row) gives zeros
    w = tl.exp(lse - top)
    total = tl.sum(w, 0)
    parts = tl.load(part_out_ptr + row[:, None] * D_PAD + d[None, :], mask=(sp < NUM_SPLITS)[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def decode_num_splits(batch: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Enough splits for about two programs per SM; depends on the batch shape only, so a
    captured CUDA graph stays valid for any context length."""
    programs = max(batch * num_kv_heads, 1)
    # A power of two: NUM_SPLITS is a compile-time constant, so at most five variants compile.
    return min(max_splits, triton.next_power_of_2(max(1, -(-2 * num_sms // programs))))


def _precision(cache_dtype: torch.dtype) -> str:
    return "ieee" if cache_dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs


def _check_block_n(block_n: int) -> None:
    # P @ V is a tl.dot over BLOCK_N keys; compiled for a GPU its K must be >= 16 (the interpreter
    # takes any size, so a smaller tile would pass the CPU tests and fail to compile on the card)
    if block_n < 16:
        raise ValueError(f"block_n must be at least 16 (tl.dot's smallest K on GPUs), got {block_n}")


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per request. q: [B, H, D]; block_tables [B, max_blocks]; seq_lens [B]
    (tokens attended to, 0 for a padding row, which gets zeros). `window`: only the last `window`
    keys (a sliding window; the table's blocks before them are never read). `softcap`: scores
    through softcap * tanh(scores / softcap). Returns [B, H, D] in q's dtype."""
    _check_block_n(block_n)
    B, H, D = q.shape
    _, block_size, kvh, _ = k_cache.shape
    group = H // kvh
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    d_pad = _pow2(D)
    if num_splits > 1:
        part_out = torch.empty(B * H * num_splits, d_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B * H * num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    quant = _quant(k_cache)
    _decode_kernel[(B, kvh, num_splits)](
        q, k_cache, v_cache, _scales(k_cache), _scales(v_cache), block_tables, seq_lens, out, part_out, part_lse,
        scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=max(16, _pow2(group)), D=D, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, NUM_HEADS=H, PRECISION=_precision(q.dtype if quant else k_cache.dtype),
        DOT_F32=_INTERPRETED, QUANT=quant, WINDOW=window or 0, SOFTCAP=softcap or 0.0,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(B, H)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            D=D, D_PAD=d_pad, NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits), NUM_HEADS=H,
        )  # fmt: skip
    return out


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    QUANT: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + seq)
    prefix = ctx_len - q_len

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = tile * BLOCK_M + rows // GROUP_PAD
    g = rows % GROUP_PAD
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    row_ok = (tok < q_len) & (g < GROUP)
    heads = kvh * GROUP + g
    q_off = (q_start + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if not QUANT:
        q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = prefix + tok  # absolute position of each row's token

    # Causal: this tile's last token sees positions <= prefix + its index; an empty tile reads nothing.
    kv_end = tl.minimum(ctx_len, prefix + (tile + 1) * BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)
    kv_start = 0
    if WINDOW > 0:  # this tile's first token sees from WINDOW - 1 positions back
        kv_start = tl.maximum(prefix + tile * BLOCK_M - WINDOW + 1, 0)

    m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, D_PAD], tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        k_off, v_off, sc_off = _kv_offsets(block, pos % BLOCK_SIZE, kvh, d, stride_cb, stride_cs, stride_ch,
                                           BLOCK_SIZE, D, QUANT)  # fmt: skip
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=kv_mask, other=0.0)
        if QUANT:
            k_sc = tl.load(k_scale_ptr + sc_off, mask=valid, other=0.0)
            s = _dot(q, tl.trans(k.to(q.dtype)), PRECISION, DOT_F32) * (k_sc * scale)[None, :]
        else:
            s = _dot(q, tl.trans(k), PRECISION, DOT_F32) * scale
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, _soft_cap(s, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + v_off, mask=kv_mask, other=0.0)
        if QUANT:
            v_sc = tl.load(v_scale_ptr + sc_off, mask=valid, other=0.0)
            pv = _dot((p * v_sc[None, :]).to(q.dtype), v.to(q.dtype), PRECISION, DOT_F32)
        else:
            pv = _dot(p.to(v.dtype), v, PRECISION, DOT_F32)
        acc = acc * alpha[:, None] + pv
        m = m_new

    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_off = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(
        out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :]
    )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    block_n: int = 64,
    rows: int = 64,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Chunks of new tokens attending causally to their whole context in the cache (or, with
    `window`, to the last `window` positions up to their own; `softcap` as in `paged_decode`).

    q, out: [T, H, D] (the flat batch); chunk i's queries are rows
    query_start_loc[i]:query_start_loc[i+1] of q and its context (prefix + chunk, already
    stored) has seq_lens[i] tokens. Rows of q outside the chunks are left alone in out."""
    _check_block_n(block_n)
    P = seq_lens.shape[0]
    if P == 0 or max_query_len == 0:
        return out
    _, H, D = q.shape
    _, block_size, kvh, _ = k_cache.shape
    group = H // kvh
    group_pad = _pow2(group)
    block_m = max(1, rows // group_pad)
    grid = (P, triton.cdiv(max_query_len, block_m), kvh)
    quant = _quant(k_cache)
    _prefill_kernel[grid](
        q, k_cache, v_cache, _scales(k_cache), _scales(v_cache), block_tables, query_start_loc, seq_lens, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=group_pad, D=D, D_PAD=_pow2(D), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q.dtype if quant else k_cache.dtype),
        DOT_F32=_INTERPRETED, QUANT=quant, WINDOW=window or 0, SOFTCAP=softcap or 0.0,
        num_stages=2 if k_cache.dtype == torch.float32 else 3,  # fp32 K/V tiles: keep shared memory in bounds
    )  # fmt: skip
    return out
