"""Quantized KV caches (int8, fp8 e4m3; rows of head_dim values + an fp32 scale, blocks laid out by
head): the packing and the layout, the Triton store / decode / prefill kernels (interpreted on the
CPU) and the C++ CPU decode kernel, each against torch on the dequantized values."""

from __future__ import annotations

import pytest
import torch

from ferry import kv_quant
from ferry.kernels.cpu import cpu_flags, cpu_kernels
from ferry.kv_quant import KEYS, ROWS, VALUES
from tests.conftest import dense_attention, int8_values_rounding

QDTYPES = [torch.int8, torch.float8_e4m3fn]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def quantized_cache(num_blocks, bs, kvh, d, dtype, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_blocks, bs, kvh, d, generator=g) * torch.rand(num_blocks, bs, kvh, 1, generator=g) * 4
    return kv_quant.blocks_of_rows(kv_quant.quantize_rows(x, dtype), layout).to(DEVICE)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_round_trip_error_is_bounded_per_row(dtype):
    """int8: at most half a step (absmax / 254); e4m3: at most half an ulp, 2**-4 of the value
    (at least 2**-10 x absmax, the subnormal step, for tiny values)."""
    x = torch.randn(64, 4, 64) * torch.logspace(-3, 2, 64)[:, None, None]
    x[0, 0] = 0.0  # an all-zero row keeps a finite scale and decodes to zeros
    packed = kv_quant.quantize_rows(x, dtype)
    assert packed.shape == (64, 4, 68) and packed.dtype == dtype
    back = kv_quant.dequantize_rows(packed)
    absmax = x.abs().amax(-1, keepdim=True)
    err = (back - x).abs()
    if dtype == torch.int8:
        assert (err <= absmax / 254 * 1.001 + 1e-30).all()
    else:
        assert (err <= torch.maximum(x.abs() * 2**-4, absmax * 2**-10) * 1.001 + 1e-30).all()
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert kv_quant.row_bytes(64, dtype) == 68 and kv_quant.head_dim_of(packed) == 64


@pytest.fixture(scope="module")
def tk():
    return pytest.importorskip("ferry.kernels.triton_attention")


@pytest.mark.parametrize("dtype", QDTYPES)
def test_triton_store_matches_torch_quantization_bit_for_bit(tk, dtype):
    kvh, d, bs = 3, 32, 4
    k_cache = torch.zeros(6, bs, kvh, d + 4, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, kvh, d, device=DEVICE) * 3
    v = torch.randn(5, kvh, d, device=DEVICE)
    slots = torch.tensor([7, 0, -1, 23, 12], device=DEVICE)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    kv_quant.store_rows(ref_k, slots[keep], k[keep], KEYS)
    kv_quant.store_rows(ref_v, slots[keep], v[keep], VALUES)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))


def tables(lens, bs, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(lens), max(-(-n // bs) for n in lens), dtype=torch.long)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        table[i, :nb] = perm[used : used + nb]
        used += nb
    return table.to(DEVICE)


def slots_of(cache, row, n):
    """The cache slots of positions 0..n-1 of the request whose blocks are `row`."""
    bs = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    return row[pos // bs] * bs + pos % bs


def gathered(cache, layout, row, n):
    """Positions 0..n-1 of one request, dequantized: [n, KVH, D]."""
    return kv_quant.dequantize_rows(kv_quant.rows_at(cache, slots_of(cache, row, n), layout))


def keys_of(cache, row, n):
    return gathered(cache, KEYS, row, n)


def values_of(cache, row, n):
    return gathered(cache, VALUES, row, n)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_reads_quantized_blocks(tk, dtype, splits):
    kvh, heads, d, bs = 2, 8, 32, 4
    lens = [1, 5, 19, 40]
    nblocks = sum(-(-n // bs) for n in lens) + 2
    k_cache = quantized_cache(nblocks, bs, kvh, d, dtype, KEYS, seed=1)
    v_cache = quantized_cache(nblocks, bs, kvh, d, dtype, VALUES, seed=2)
    table = tables(lens, bs, nblocks)
    q = torch.randn(len(lens), heads, d, device=DEVICE)
    out = tk.paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, device=DEVICE), d**-0.5, splits, block_n=16)
    for i, n in enumerate(lens):
        ref = dense_attention(q[i : i + 1], keys_of(k_cache, table[i], n), values_of(v_cache, table[i], n),
                              torch.tensor([n - 1], device=DEVICE), d**-0.5)  # fmt: skip
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_triton_prefill_reads_quantized_prefix_and_chunk(tk, dtype):
    kvh, heads, d, bs = 2, 4, 32, 4
    chunks = [(0, 6), (5, 9), (bs, 1)]  # (cached prefix, new tokens)
    lens = [p + n for p, n in chunks]
    nblocks = sum(-(-n // bs) for n in lens) + 2
    k_cache = quantized_cache(nblocks, bs, kvh, d, dtype, KEYS, seed=3)
    v_cache = quantized_cache(nblocks, bs, kvh, d, dtype, VALUES, seed=4)
    table = tables(lens, bs, nblocks)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, d, device=DEVICE)
    out = torch.zeros_like(q)
    tk.paged_prefill(q, k_cache, v_cache, table, torch.tensor(starts, device=DEVICE), torch.tensor(lens, device=DEVICE),
                     max(n for _, n in chunks), d**-0.5, out, block_n=16, rows=16)  # fmt: skip
    for i, (prefix, n) in enumerate(chunks):
        s, ctx = starts[i], prefix + n
        ref = dense_attention(q[s : s + n], keys_of(k_cache, table[i], ctx), values_of(v_cache, table[i], ctx),
                              torch.arange(prefix, ctx, device=DEVICE), d**-0.5)  # fmt: skip
        torch.testing.assert_close(out[s : s + n], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cpu", reason="the C++ kernel is the CPU's")
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (3, 3), (10, 2)])
@pytest.mark.parametrize("bs, d", [(4, 32), (16, 64)])  # 16-token blocks: 8 keys per vector step
def test_cpu_decode_kernel_reads_quantized_blocks(dtype, heads, kv_heads, bs, d):
    kernels = cpu_kernels()
    if kernels is None:
        pytest.fail("the CPU kernels did not build (a compiler is part of the test set-up)")
    nb = 30
    k_cache = quantized_cache(nb, bs, kv_heads, d, dtype, KEYS, seed=5)
    v_cache = quantized_cache(nb, bs, kv_heads, d, dtype, VALUES, seed=6)
    lens = [1, 5, 16, 9, 23] + ([70, 13] if bs == 16 else [])
    table = tables(lens, bs, nb)
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(7))  # not the global RNG
    got = kernels.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(lens), d**-0.5)
    q_as_used = q
    if dtype == torch.int8 and "avx2" in cpu_flags():
        # With AVX2 the int8 path dots int8 K with q rounded to int16 per head (2^-15 of its largest
        # value): the reference takes the same q, and the result matches it to fp32 rounding.
        step = q.abs().amax(dim=-1, keepdim=True) / 32767
        q_as_used = torch.round(q / step) * step
        unrounded = [dense_attention(q[i : i + 1], keys_of(k_cache, table[i], n), values_of(v_cache, table[i], n),
                                     torch.tensor([n - 1]), d**-0.5) for i, n in enumerate(lens)]  # fmt: skip
        # and q's rounding is small: its step (|q|max / 32767, ~1e-4) over 64 keys of up to |12| moves a
        # logit by ~1e-4, the output (values up to |12|) by up to ~1e-3; 100 random q gave 2e-4..9e-4.
        torch.testing.assert_close(got, torch.cat(unrounded), rtol=0, atol=2e-3)
    # The AVX-512 build sums an int8 cache's values in integers where head_dim is a multiple of 64, the
    # AVX2 one where it is a multiple of 16, with the softmax weights rounded to int16
    # (int8_values_rounding bounds what that moves).
    isa = kernels.paged_decode_attention_isa()
    int_values = dtype == torch.int8 and (isa == "avx512" and d % 64 == 0 or isa == "avx2" and d % 16 == 0)
    for i, n in enumerate(lens):
        ref = dense_attention(q_as_used[i : i + 1], keys_of(k_cache, table[i], n), values_of(v_cache, table[i], n),
                              torch.tensor([n - 1]), d**-0.5)  # fmt: skip
        # fp32 rounding: a 70-token row merges two partitions and sums 70 exponentials (~2e-5 seen)
        tolerance = 5e-5 + 1e-4 * ref.abs()
        if int_values:
            rows = kv_quant.rows_at(v_cache, slots_of(v_cache, table[i], n), VALUES)  # [n, KVH, D + 4]
            tolerance = tolerance + int8_values_rounding(rows, d, heads // kv_heads)
        assert ((got[i : i + 1] - ref).abs() <= tolerance).all(), (n, (got[i : i + 1] - ref).abs().max())


COMPILE_SCRIPT = r"""
import json, torch
from dataclasses import asdict
from ferry.tools.compile_check import compiling_for, report
from ferry.kernels import triton_attention as attn
for dt in (torch.int8, torch.float8_e4m3fn):
    kc = torch.empty(4, 16, 8, 128 + 4, dtype=dt)  # Llama-3.1-8B's KV geometry
    q = torch.empty(64, 32, 128, dtype=torch.bfloat16)
    k = torch.empty(64, 8, 128, dtype=torch.bfloat16)
    t = torch.zeros(8, 8, dtype=torch.int64)
    n = torch.ones(8, dtype=torch.int64)
    with compiling_for(90) as compiled:
        attn.store_kv(k, k, kc, kc, torch.zeros(64, dtype=torch.int64))
        attn.paged_decode(q[:8], kc, kc, t, n, 0.1, 2, out=torch.empty(8, 32, 128, dtype=torch.bfloat16))
        attn.paged_prefill(q, kc, kc, t, torch.zeros(9, dtype=torch.int64), n, 64, 0.1, torch.empty_like(q))
    for name, kern in compiled:
        print(json.dumps(asdict(report(name, str(dt), kern, 90))))
"""


def test_quantized_kernel_variants_compile_for_sm90():
    """The int8 / fp8 store, decode and prefill kernels compile for an H100 within its limits, no
    spills, dots on tensor cores (no GPU here: Triton's own compiler and ptxas, tools/compile_check)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {(r["kernel"], r["case"]) for r in rows} >= {
        (k, c)
        for k in ("_store_kv_kernel", "_decode_kernel", "_prefill_kernel")
        for c in ("torch.int8", "torch.float8_e4m3fn")
    }
    for r in rows:
        assert r["problems"] == [] and r["local_bytes"] == 0, r
        if r["kernel"] in ("_decode_kernel", "_prefill_kernel"):
            assert r["tensor_cores"] in ("mma", "wgmma"), r


@pytest.mark.parametrize("layout", [KEYS, VALUES, ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *QDTYPES])
def test_cpu_store_kv_rows_writes_store_rows_bytes(dtype, layout):
    """The C++ store (store_kv_rows, the CPU backend's) writes byte for byte what kv_quant.store_rows
    writes: rows of a qkv split (strided), an all-zero row, int8 ties at exactly .5 (half away from
    zero), values past bf16's precision; a negative slot writes nothing."""
    kernels = cpu_kernels()
    g = torch.Generator().manual_seed(0)
    nb, bs, kvh, d, t = 12, 16, 3, 64, 40
    qkv = torch.randn(t, (9 + 2 * kvh) * d, generator=g) * 3
    k = qkv[:, 9 * d : (9 + kvh) * d].view(t, kvh, d)
    k[0] = 0.0
    k[1, 0] = 0.0
    k[1, 0, :6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.0 + 2**-10])  # scale 1: ties
    slots = torch.randperm(nb * bs, generator=g)[:t]
    width = kv_quant.row_width(d, dtype)
    want = torch.zeros(nb, bs, kvh, width, dtype=dtype)
    got = torch.zeros(nb, bs, kvh, width, dtype=dtype)
    kv_quant.store_rows(want, slots, k, layout)
    kernels.store_kv_rows(got, slots, k, kv_quant.LAYOUT_IDS[layout])
    assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    skipped = slots.clone()
    skipped[:5] = -1
    before = got.clone()
    kernels.store_kv_rows(got, skipped, k * 2, kv_quant.LAYOUT_IDS[layout])
    rows, rows_before = kv_quant.rows_at(got, slots, layout), kv_quant.rows_at(before, slots, layout)
    assert torch.equal(rows[:5].view(torch.uint8), rows_before[:5].view(torch.uint8))
    assert not torch.equal(rows[5:].view(torch.uint8), rows_before[5:].view(torch.uint8))


@pytest.mark.parametrize("layout", [KEYS, VALUES, ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *QDTYPES])
def test_copy_slots_moves_each_tokens_rows_and_nothing_else(dtype, layout):
    """What tree verification does with the drafts it kept: slot src[i]'s rows (values and scale, as
    stored) land in slot dst[i], within a block and across blocks; every other slot keeps its bytes."""
    g = torch.Generator().manual_seed(0)
    nb, bs, kvh, d = 4, 8, 3, 16
    cache = torch.zeros(nb, bs, kvh, kv_quant.row_width(d, dtype), dtype=dtype)
    every = torch.arange(nb * bs)
    kv_quant.store_rows(cache, every, torch.randn(nb * bs, kvh, d, generator=g), layout)
    before = kv_quant.rows_at(cache, every, layout).view(torch.uint8).clone()
    src, dst = torch.tensor([13, 14, 20, 3]), torch.tensor([10, 11, 12, 25])
    kv_quant.copy_slots(cache, src, dst, layout)
    after = kv_quant.rows_at(cache, every, layout).view(torch.uint8)
    want = before.clone()
    want[dst] = before[src]
    assert torch.equal(after, want)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_block_layout_puts_each_value_where_the_docstring_says(dtype):
    """Head h's part of block b is block_size rows' bytes from (b * KVH + h) * BS * W: K's value d of
    token t at (d // 2 * BS + t) * 2 + d % 2, V's at (t // 2 * D + d) * 2 + t % 2, then the BS scales;
    rows_at / store_rows / blocks_of_rows / rows_of_blocks agree with that and with each other."""
    g = torch.Generator().manual_seed(0)
    nb, bs, kvh, d = 5, 6, 3, 8
    w = d + 4
    rows = kv_quant.quantize_rows(torch.randn(nb, bs, kvh, d, generator=g), dtype)
    rb = rows.view(torch.uint8)
    for layout in (KEYS, VALUES):
        blocks = kv_quant.blocks_of_rows(rows, layout)
        assert blocks.shape == rows.shape and blocks.dtype == dtype
        heads = blocks.view(torch.uint8).reshape(nb, kvh, bs * w)
        for b, h, t, i in [(0, 0, 0, 0), (2, 1, 5, 7), (4, 2, 3, 4), (1, 2, 4, 1)]:
            at = (i // 2 * bs + t) * 2 + i % 2 if layout == KEYS else (t // 2 * d + i) * 2 + t % 2
            assert heads[b, h, at] == rb[b, t, h, i]
            assert torch.equal(heads[b, h, d * bs + 4 * t : d * bs + 4 * t + 4], rb[b, t, h, d:])
        assert torch.equal(kv_quant.rows_of_blocks(blocks, layout).view(torch.uint8), rb)
        slots = torch.tensor([29, 0, 7, 13])
        assert torch.equal(kv_quant.rows_at(blocks, slots, layout).view(torch.uint8), rb.view(-1, kvh, w)[slots])
        x = torch.randn(len(slots), kvh, d, generator=g)
        stored = blocks.clone()
        kv_quant.store_rows(stored, slots, x, layout)
        want = rows.clone().view(-1, kvh, w)
        want.view(torch.uint8)[slots] = kv_quant.quantize_rows(x, dtype).view(torch.uint8)
        assert torch.equal(
            kv_quant.rows_of_blocks(stored, layout).view(torch.uint8), want.view(torch.uint8).view_as(rb)
        )
        # A slot outside the cache names no block: refused, nothing written (not another block's bytes).
        for bad in (-1, nb * bs):
            before = stored.clone()
            with pytest.raises(IndexError, match="slots must be in"):
                kv_quant.store_rows(stored, torch.tensor([3, bad]), x[:2], layout)
            with pytest.raises(IndexError, match="slots must be in"):
                kv_quant.rows_at(stored, torch.tensor([bad]), layout)
            assert torch.equal(stored.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.skipif(DEVICE != "cpu", reason="the C++ kernel is the CPU's")
def test_cpu_decode_int8_blocks_read_in_place_match_gathered_rows_bit_for_bit():
    """The AVX-512 and AVX2 builds read an int8 cache of 16-token blocks in its layout, 16 keys per
    vector or two of 8, and gather rows for other block sizes; both sum exact int32 dots and round the
    weights alike, so the
    same keys in 16- and 4-token blocks (one 64-key partition either way) give the same output bit for
    bit, with a draft tree and with a sliding window's skipped keys too."""
    kernels = cpu_kernels()
    g = torch.Generator().manual_seed(11)
    heads, kvh, d, n_seq = 9, 3, 64, 5
    lens = torch.tensor([70, 1, 33, 200, 17])
    x_k = torch.randn(n_seq, 208, kvh, d, generator=g)
    x_v = torch.randn(n_seq, 208, kvh, d, generator=g)
    q = torch.randn(n_seq, heads, d, generator=g)

    def cache_of(bs):
        """Each sequence's 208 positions in its own run of blocks (shuffled), and their tables."""
        per = 208 // bs
        order = torch.randperm(n_seq * per, generator=torch.Generator().manual_seed(bs))
        k = torch.zeros(n_seq * per, bs, kvh, d)
        v = torch.zeros_like(k)
        k[order] = x_k.reshape(n_seq * per, bs, kvh, d)
        v[order] = x_v.reshape(n_seq * per, bs, kvh, d)
        caches = [kv_quant.blocks_of_rows(kv_quant.quantize_rows(c, torch.int8), lay)
                  for c, lay in ((k, KEYS), (v, VALUES))]  # fmt: skip
        return caches, order.view(n_seq, per)

    (k16, v16), t16 = cache_of(16)
    (k4, v4), t4 = cache_of(4)
    scale = d**-0.5
    assert torch.equal(kernels.paged_decode_attention(q, k16, v16, t16, lens, scale),
                       kernels.paged_decode_attention(q, k4, v4, t4, lens, scale))  # fmt: skip
    start = (lens - 6).clamp(min=0)  # the last up-to-6 positions are drafts; each row sees alternate ones
    tree = torch.stack([start, torch.tensor([0b101101 if n >= 6 else 1 << (int(n) - 1) for n in lens])], 1)
    assert torch.equal(kernels.paged_decode_attention(q, k16, v16, t16, lens, scale, tree),
                       kernels.paged_decode_attention(q, k4, v4, t4, lens, scale, tree))  # fmt: skip
    first = (lens - 40).clamp(min=0)  # a 40-key window: tables from the block holding its first key
    outs = []
    for (kc, vc), table, bs in (((k16, v16), t16, 16), ((k4, v4), t4, 4)):
        rows = [table[i, int(f) // bs :] for i, f in enumerate(first)]
        width = max(len(r) for r in rows)
        tables_w = torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])
        lens_w = lens - first // bs * bs
        outs.append(kernels.paged_decode_attention(q, kc, vc, tables_w, lens_w, scale, None, first % bs))
    assert torch.equal(outs[0], outs[1])
