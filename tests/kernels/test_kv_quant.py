"""Quantized KV caches (int8, fp8 e4m3; rows of head_dim values + an fp32 scale): the packing,
the Triton store / decode / prefill kernels (interpreted on the CPU) and the C++ CPU decode
kernel, each against torch on the dequantized values."""

from __future__ import annotations

import pytest
import torch

from ferry import kv_quant
from ferry.kernels.cpu import cpu_flags, cpu_kernels
from tests.conftest import dense_attention, int8_values_rounding

QDTYPES = [torch.int8, torch.float8_e4m3fn]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def quantized_cache(num_blocks, bs, kvh, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_blocks, bs, kvh, d, generator=g) * torch.rand(num_blocks, bs, kvh, 1, generator=g) * 4
    return kv_quant.quantize_rows(x, dtype).to(DEVICE)


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
    kv_quant.store_rows(ref_k, slots[keep], k[keep])
    kv_quant.store_rows(ref_v, slots[keep], v[keep])
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


def gathered(cache, row, n):
    """Positions 0..n-1 of one request, dequantized: [n, KVH, D]."""
    bs = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    return kv_quant.dequantize_rows(cache[row[pos // bs], pos % bs])


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_reads_quantized_blocks(tk, dtype, splits):
    kvh, heads, d, bs = 2, 8, 32, 4
    lens = [1, 5, 19, 40]
    nblocks = sum(-(-n // bs) for n in lens) + 2
    k_cache = quantized_cache(nblocks, bs, kvh, d, dtype, seed=1)
    v_cache = quantized_cache(nblocks, bs, kvh, d, dtype, seed=2)
    table = tables(lens, bs, nblocks)
    q = torch.randn(len(lens), heads, d, device=DEVICE)
    out = tk.paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, device=DEVICE), d**-0.5, splits, block_n=16)
    for i, n in enumerate(lens):
        ref = dense_attention(q[i : i + 1], gathered(k_cache, table[i], n), gathered(v_cache, table[i], n),
                              torch.tensor([n - 1], device=DEVICE), d**-0.5)  # fmt: skip
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_triton_prefill_reads_quantized_prefix_and_chunk(tk, dtype):
    kvh, heads, d, bs = 2, 4, 32, 4
    chunks = [(0, 6), (5, 9), (bs, 1)]  # (cached prefix, new tokens)
    lens = [p + n for p, n in chunks]
    nblocks = sum(-(-n // bs) for n in lens) + 2
    k_cache = quantized_cache(nblocks, bs, kvh, d, dtype, seed=3)
    v_cache = quantized_cache(nblocks, bs, kvh, d, dtype, seed=4)
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
        ref = dense_attention(q[s : s + n], gathered(k_cache, table[i], ctx), gathered(v_cache, table[i], ctx),
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
    k_cache = quantized_cache(nb, bs, kv_heads, d, dtype, seed=5)
    v_cache = quantized_cache(nb, bs, kv_heads, d, dtype, seed=6)
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
        unrounded = [dense_attention(q[i : i + 1], gathered(k_cache, table[i], n), gathered(v_cache, table[i], n),
                                     torch.tensor([n - 1]), d**-0.5) for i, n in enumerate(lens)]  # fmt: skip
        # and q's rounding is small: its step (|q|max / 32767, ~1e-4) over 64 keys of up to |12| moves a
        # logit by ~1e-4, the output (values up to |12|) by up to ~1e-3; 100 random q gave 2e-4..9e-4.
        torch.testing.assert_close(got, torch.cat(unrounded), rtol=0, atol=2e-3)
    # The AVX-512 build sums an int8 cache's values (head_dim a multiple of 64) in integers, with the
    # softmax weights rounded to int16 (int8_values_rounding bounds what that moves).
    int_values = dtype == torch.int8 and d % 64 == 0 and kernels.paged_decode_attention_isa() == "avx512"
    for i, n in enumerate(lens):
        ref = dense_attention(q_as_used[i : i + 1], gathered(k_cache, table[i], n), gathered(v_cache, table[i], n),
                              torch.tensor([n - 1]), d**-0.5)  # fmt: skip
        # fp32 rounding: a 70-token row merges two partitions and sums 70 exponentials (~2e-5 seen)
        tolerance = 5e-5 + 1e-4 * ref.abs()
        if int_values:
            pos = torch.arange(n)
            rows = v_cache[table[i][pos // bs], pos % bs]  # [n, KVH, D + 4]
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *QDTYPES])
def test_cpu_store_kv_rows_writes_store_rows_bytes(dtype):
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
    kv_quant.store_rows(want, slots, k)
    kernels.store_kv_rows(got, slots, k)
    assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    skipped = slots.clone()
    skipped[:5] = -1
    before = got.clone()
    kernels.store_kv_rows(got, skipped, k * 2)
    rows = got.view(-1, kvh, width)
    assert torch.equal(rows[slots[:5]].view(torch.uint8), before.view(-1, kvh, width)[slots[:5]].view(torch.uint8))
    assert not torch.equal(rows[slots[5:]].view(torch.uint8), before.view(-1, kvh, width)[slots[5:]].view(torch.uint8))
