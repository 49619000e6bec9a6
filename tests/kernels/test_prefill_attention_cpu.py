"""The C++ paged prefill attention (paged_prefill_attention_cpu.cpp) against dense causal attention
over the same dequantized cache rows, and through the torch backend against its SDPA path."""

import numpy as np
import pytest
import torch

from ferry.kernels.cpu import cpu_flags
from ferry.kv_quant import KEYS, VALUES, dequantize_rows, is_quantized, quantize_blocks, rows_at
from ferry.layers.attention import TorchAttentionBackend, build_metadata
from ferry.layers.attention.metadata import PrefillHost
from tests.conftest import outputs_of_both_cpu_builds


def random_cache(nb, bs, kvh, d, dtype, gen, layout):
    x = torch.randn(nb, bs, kvh, d, generator=gen)
    if is_quantized(dtype):
        return quantize_blocks(x, dtype, layout)
    return x.to(dtype)


def as_float(cache):
    return dequantize_rows(cache) if is_quantized(cache.dtype) else cache.float()


def dense_chunk(q, k_cache, v_cache, blocks, length, context, scale, window):
    """q [length, H, D] of rows at positions context - length .. context - 1, attending causally
    (and within `window`) to the request's keys 0 .. context - 1 read through its blocks."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = q.shape[1] // kvh
    pos = torch.arange(context)
    slots = torch.as_tensor(blocks)[pos // bs] * bs + pos % bs
    kk = as_float(rows_at(k_cache, slots, KEYS)).repeat_interleave(g, 1).transpose(0, 1)
    vv = as_float(rows_at(v_cache, slots, VALUES)).repeat_interleave(g, 1).transpose(0, 1)
    qpos = torch.arange(context - length, context)[:, None]
    mask = pos[None, :] <= qpos
    if window:
        mask &= pos[None, :] > qpos - window
    s = (q.transpose(0, 1) @ kk.transpose(1, 2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vv).transpose(0, 1)


def chunks_case(heads, kvh, d, bs, dtype, spans, window, seed=0):
    """Random caches; chunks (length, context) with their own blocks; q for the flat batch with a
    decode-like row in front (left untouched by the kernel)."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-ctx // bs) for _, ctx in spans)
    nb = need + 3
    k_cache, v_cache = random_cache(nb, bs, kvh, d, dtype, gen, KEYS), random_cache(nb, bs, kvh, d, dtype, gen, VALUES)
    perm = torch.randperm(nb, generator=gen).numpy()
    tables, rows, used, row = [], [], 0, 1
    for length, ctx in spans:
        n = -(-ctx // bs)
        tables.append(perm[used : used + n])
        rows.append((row, length, ctx))
        used += n
        row += length
    q = torch.randn(row, heads, d, generator=gen) * 2
    maxb = max(len(t) for t in tables)
    table = torch.zeros(len(tables), maxb, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.from_numpy(t)
    return q, k_cache, v_cache, table, torch.tensor(rows, dtype=torch.long), tables


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 4, 32), (8, 1, 64), (32, 2, 16), (6, 2, 40)])
@pytest.mark.parametrize("bs", [16, 5])
def test_prefill_kernel_matches_dense(kernels, cache_dtype, heads, kv_heads, d, bs):
    """Whole prompts, chunks after a cached prefix (one longer than a 1,024-key range), a one-row chunk;
    GQA groups below, at and above the 12 query vectors a pass takes (G = 3, 1, 8, 16), head sizes with
    and without a multiple of 16 (the vector and the plain loops), blocks not a multiple of 16 keys."""
    if is_quantized(cache_dtype) and bs % 2:
        bs += 1  # a quantized cache's blocks hold pairs of tokens (kv_quant.py)
    spans = [(37, 37), (1, 20), (70, 300), (200, 1100), (16, 16)]
    q, kc, vc, table, rows, tables = chunks_case(heads, kv_heads, d, bs, cache_dtype, spans, 0)
    out = torch.full_like(q, 7.0)
    kernels.paged_prefill_attention(q, kc, vc, table, rows, d**-0.5, 0, out)
    assert (out[0] == 7.0).all()  # not a chunk's row
    for (start, length, ctx), blocks in zip(rows.tolist(), tables):
        want = dense_chunk(q[start : start + length], kc, vc, blocks, length, ctx, d**-0.5, 0)
        torch.testing.assert_close(out[start : start + length], want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window", [1, 7, 16, 100, 1500])
def test_prefill_kernel_sliding_window(kernels, window):
    """Each row sees only the last `window` keys up to itself, across 16-key tiles and 1,024-key ranges."""
    spans = [(300, 300), (90, 1200), (3, 40)]
    q, kc, vc, table, rows, tables = chunks_case(8, 2, 64, 16, torch.bfloat16, spans, window, seed=3)
    out = torch.empty_like(q)
    kernels.paged_prefill_attention(q, kc, vc, table, rows, 0.125, window, out)
    for (start, length, ctx), blocks in zip(rows.tolist(), tables):
        want = dense_chunk(q[start : start + length], kc, vc, blocks, length, ctx, 0.125, window)
        torch.testing.assert_close(out[start : start + length], want, rtol=2e-5, atol=2e-5)


def test_prefill_kernel_refuses_bad_spans(kernels):
    q, kc, vc, table, rows, _ = chunks_case(4, 2, 32, 16, torch.float32, [(10, 30)], 0)
    out = torch.empty_like(q)
    bad = rows.clone()
    bad[0, 2] = 10_000  # a context longer than the table
    with pytest.raises(RuntimeError, match="context longer than its table"):
        kernels.paged_prefill_attention(q, kc, vc, table, bad, 0.1, 0, out)
    bad = rows.clone()
    bad[0, 1] = 40  # more rows than the context
    with pytest.raises(RuntimeError, match="span outside q or context"):
        kernels.paged_prefill_attention(q, kc, vc, table, bad, 0.1, 0, out)
    bad_table = table.clone()
    bad_table[0, 0] = kc.shape[0]
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_prefill_attention(q, kc, vc, bad_table, rows, 0.1, 0, out)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("window", [None, 24])
def test_backend_prefill_paths_agree(kernels, cache_dtype, window):
    """The torch backend's step (decode rows and prefill chunks, K/V stored first) gives its prefill
    rows the same attention with the C++ prefill kernel as with its SDPA path (the decode rows' two
    paths are compared in test_cpu_kernels.py: with an int8 cache they round apart by more)."""
    gen = torch.Generator().manual_seed(11)
    bs, kvh, heads, d, nb = 16, 3, 9, 64, 40
    k_cache = random_cache(nb, bs, kvh, d, cache_dtype, gen, KEYS)
    v_cache = random_cache(nb, bs, kvh, d, cache_dtype, gen, VALUES)
    # Two decode rows, then a whole prompt of 50 and a 30-token chunk after 70 cached tokens.
    blocks = [np.arange(1, 6), np.arange(6, 10), np.arange(10, 14), np.arange(14, 21)]
    dec_lens = np.array([70, 33])
    prefills = [PrefillHost(start=2, length=50, context_len=50, block_ids=blocks[2]),
                PrefillHost(start=52, length=30, context_len=100, block_ids=blocks[3])]  # fmt: skip
    slots = [blocks[0][69 // bs] * bs + 69 % bs, blocks[1][32 // bs] * bs + 32 % bs]
    slots += [blocks[2][p // bs] * bs + p % bs for p in range(50)]
    slots += [blocks[3][p // bs] * bs + p % bs for p in range(70, 100)]
    t = len(slots)
    q, k, v = (torch.randn(t, n, d, generator=gen) for n in (heads, kvh, kvh))
    outs = []
    for use_kernel in (True, False):
        backend = TorchAttentionBackend(torch.device("cpu"), use_cpu_kernel=use_kernel)
        meta = build_metadata(
            slot_mapping=np.array(slots, dtype=np.int64), block_size=bs, decode_blocks=blocks[:2],
            decode_seq_lens=dec_lens, prefills=prefills, device=torch.device("cpu"), backend=backend,
        )  # fmt: skip
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(backend.forward(q, k, v, kc, vc, meta, d**-0.5, window=window))
    torch.testing.assert_close(outs[0][2:], outs[1][2:], rtol=2e-5, atol=2e-5)


_PREFILL_ISA_SCRIPT = r"""
import sys, torch
from ferry.kernels.cpu import cpu_kernels
from tests.kernels.test_prefill_attention_cpu import chunks_case
out = {}
for d in (64, 40):
    for name in ("float32", "int8"):
        q, kc, vc, table, rows, _ = chunks_case(9, 3, d, 16, getattr(torch, name), [(40, 40), (60, 1100)], 0)
        o = torch.zeros_like(q)
        cpu_kernels().paged_prefill_attention(q, kc, vc, table, rows, d**-0.5, 0, o)
        out[f"{name} d={d}"] = o
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="without AVX-512 the native build is the AVX2 build")
def test_prefill_attention_avx512_and_avx2_builds_agree(tmp_path):
    """The AVX-512 tiles and the plain loops an AVX2-only CPU runs give the same attention to fp32
    rounding."""
    avx2, native = outputs_of_both_cpu_builds(_PREFILL_ISA_SCRIPT, tmp_path)
    assert set(native) == set(avx2) and len(native) == 4
    for case, y in native.items():
        torch.testing.assert_close(y, avx2[case], rtol=2e-5, atol=2e-5, msg=case)
