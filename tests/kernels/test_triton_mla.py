"""MLA's absorbed decode kernel (ferry/kernels/triton_mla.py) against a dense torch reference, and the
latent rows' store. On the CPU under TRITON_INTERPRET=1 (conftest); on a CUDA machine compiled."""

from __future__ import annotations

import pytest
import torch

from ferry.kv_quant import dequantize_rows, quantize_rows, row_width
from tests.kernels.test_triton_attention import DEVICE, gather, random_tables

triton_mla = pytest.importorskip("ferry.kernels.triton_mla")
triton_attention = pytest.importorskip("ferry.kernels.triton_attention")


def latent_cache(num_blocks, bs, width, dtype, seed=0):
    """A cache of random latent rows [num_blocks, bs, 1, width] (quantized rows carry their scale)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_blocks * bs, 1, width, generator=g).to(DEVICE)
    if dtype in (torch.int8, torch.float8_e4m3fn):
        return quantize_rows(rows, dtype).view(num_blocks, bs, 1, row_width(width, dtype))
    return rows.to(dtype).view(num_blocks, bs, 1, width)


def reference(q, cache, table_row, n, scale, rank):
    """One request: softmax(q . rows^T * scale) @ rows[:, :rank] in fp32, every head over the same rows."""
    rows = gather(cache, table_row, n)[:, 0]  # [n, W]
    rows = dequantize_rows(rows, torch.float32) if cache.dtype in (torch.int8, torch.float8_e4m3fn) else rows.float()
    p = torch.softmax(q.float() @ rows.T * scale, dim=-1)
    return p @ rows[:, :rank]


@pytest.mark.parametrize(
    "heads,rank,rope,bs,splits,dtype",
    [
        (16, 64, 16, 4, 1, torch.float32),  # one block of heads, one split
        (20, 48, 16, 16, 3, torch.float32),  # two head blocks (the second part-filled), rank not a power of two
        (4, 32, 8, 16, 2, torch.float32),  # fewer heads than a block, rope narrower than a dot's 16
        (16, 64, 16, 4, 2, torch.bfloat16),
        (16, 64, 16, 4, 2, torch.int8),  # quantized rows: the scale on the scores and the values
        (16, 64, 16, 4, 1, torch.float8_e4m3fn),
    ],
)
def test_latent_decode_matches_reference(heads, rank, rope, bs, splits, dtype):
    lens = [1, bs, bs + 1, 3 * bs - 1, 70, 0]  # block boundaries, several tiles, a padding row (0)
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    cache = latent_cache(num_blocks, bs, rank + rope, dtype)
    table = random_tables(lens, bs, num_blocks)
    # bf16 queries over a bf16 or fp8 cache; over int8, bf16 on a GPU and fp32 in the interpreter (whose
    # int8 -> bf16 conversion yields NaNs, for the attention kernel's int8 decode as well)
    q_dtype = torch.float32 if dtype == torch.float32 or (dtype == torch.int8 and DEVICE == "cpu") else torch.bfloat16
    q = torch.randn(len(lens), heads, rank + rope, device=DEVICE).to(q_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    scale = (rank + rope) ** -0.5
    out = torch.full((len(lens), heads, rank), float("nan"), dtype=q_dtype, device=DEVICE)
    triton_mla.paged_latent_decode(q, cache, table, seq_lens, scale, rank, splits, out=out)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))  # written, as zeros
            continue
        ref = reference(q[i], cache, table[i], n, scale, rank)
        torch.testing.assert_close(out[i].float(), ref, rtol=tol, atol=tol)


def test_latent_decode_refuses_a_per_head_cache():
    cache = torch.zeros(4, 4, 2, 80, device=DEVICE)
    q = torch.zeros(1, 16, 80, device=DEVICE)
    one = torch.ones(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="one row of rank"):
        triton_mla.paged_latent_decode(q, cache, one.view(1, 1), one, 0.1, 64, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_store_without_v_writes_one_cache_and_skips_padding(dtype):
    """store_kv(k, None, cache, None, slots): MLA's rows into its one cache; slot -1 writes nothing."""
    width = 80
    cache = latent_cache(4, 4, width, dtype)
    before = cache.clone()
    rows = torch.randn(3, 1, width, device=DEVICE)
    slots = torch.tensor([5, -1, 12], device=DEVICE)
    triton_attention.store_kv(rows, None, cache, None, slots)
    flat, old = cache.view(16, -1), before.view(16, -1)
    want = quantize_rows(rows, dtype) if dtype == torch.int8 else rows
    for t, s in ((0, 5), (2, 12)):
        got = flat[s].view(torch.uint8) if dtype == torch.int8 else flat[s]
        exp = want[t].reshape(-1).view(torch.uint8) if dtype == torch.int8 else want[t].reshape(-1)
        assert torch.equal(got, exp)
    untouched = [i for i in range(16) if i not in (5, 12)]
    assert torch.equal(flat[untouched].view(torch.uint8) if dtype == torch.int8 else flat[untouched],
                       old[untouched].view(torch.uint8) if dtype == torch.int8 else old[untouched])  # fmt: skip


def test_latent_attention_backends():
    """MLA: auto is the torch backend on the CPU (Triton on CUDA), triton when asked (here interpreted,
    its decode programs counted per 16 heads), flashinfer refused with a reason."""
    from ferry.layers.attention import select_attention_backend

    dims = dict(num_heads=40, num_kv_heads=40, head_dim=16, dtype=torch.float32, cache_dtype=torch.float32,
                latent=True)  # fmt: skip
    device = torch.device(DEVICE)
    assert select_attention_backend("auto", device, **dims).name == ("triton" if DEVICE == "cuda" else "torch")
    triton_backend = select_attention_backend("triton", device, **dims)
    assert triton_backend.name == "triton" and triton_backend.num_kv_heads == 3  # 40 heads: 3 programs
    with pytest.raises(ValueError, match="flashinfer does not run multi-head latent attention"):
        select_attention_backend("flashinfer", device, **dims)
