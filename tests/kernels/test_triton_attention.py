"""The Triton paged-attention kernels against a dense torch reference.

On the CPU these run under TRITON_INTERPRET=1 (set in conftest before triton is
imported); on a CUDA machine the same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import dense_attention

triton_attention = pytest.importorskip("ferry.kernels.triton_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_cache(num_blocks, block_size, kvh, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(DEVICE, dtype)
    return k, v


def random_tables(lens, block_size, num_blocks, seed=0):
    """Distinct, shuffled physical blocks per request (block 0 left unused)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    width = max(-(-n // block_size) for n in lens) if lens else 1
    table = torch.zeros(len(lens), max(width, 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        table[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    return table.to(DEVICE)


def gather(cache, table_row, n):
    block_size = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    blocks = table_row.long()[pos // block_size]
    return cache[blocks, pos % block_size]  # [n, KVH, D]


@pytest.mark.parametrize("kvh,heads", [(2, 8), (1, 4), (3, 3)])
def test_store_kv_writes_slots_and_skips_padding(kvh, heads):
    num_blocks, bs, d = 6, 4, 32
    k_cache, v_cache = make_cache(num_blocks, bs, kvh, d)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k = torch.randn(5, kvh, d, device=DEVICE)
    v = torch.randn(5, kvh, d, device=DEVICE)
    slots = torch.tensor([7, 0, -1, 23, 12], device=DEVICE)
    triton_attention.store_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_before.view(-1, kvh, d), v_before.view(-1, kvh, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            flat_k[s], flat_v[s] = k[t], v[t]
    torch.testing.assert_close(k_cache.view(-1, kvh, d), flat_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache.view(-1, kvh, d), flat_v, rtol=0, atol=0)


def test_store_kv_casts_to_cache_dtype():
    k_cache, v_cache = make_cache(2, 4, 2, 16, dtype=torch.bfloat16)
    k, v = torch.randn(3, 2, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    triton_attention.store_kv(k, v, k_cache, v_cache, torch.tensor([1, 2, 5], device=DEVICE))
    # Within one bf16 step: Triton's interpreter truncates where the GPU rounds to nearest.
    assert k_cache.dtype == torch.bfloat16
    torch.testing.assert_close(k_cache.view(-1, 2, 16)[5].float(), k[2], rtol=2**-7, atol=0)
    torch.testing.assert_close(v_cache.view(-1, 2, 16)[1].float(), v[0], rtol=2**-7, atol=0)


@pytest.mark.parametrize(
    "kvh,heads,d,bs,splits",
    [
        (2, 8, 32, 4, 1),  # GQA, one split
        (2, 8, 32, 4, 3),  # GQA, split-KV with a merge
        (1, 6, 48, 16, 2),  # MQA, head_dim not a power of two
        (4, 4, 64, 16, 4),  # MHA
    ],
)
def test_paged_decode_matches_reference(kvh, heads, d, bs, splits):
    lens = [1, bs, bs + 1, 3 * bs - 1, 70]  # block boundaries, a lone token, several BLOCK_N tiles
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    k_cache, v_cache = make_cache(num_blocks, bs, kvh, d)
    table = random_tables(lens, bs, num_blocks)
    q = torch.randn(len(lens), heads, d, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    out = triton_attention.paged_decode(q, k_cache, v_cache, table, seq_lens, scale, splits, block_n=16)
    for i, n in enumerate(lens):
        ref = dense_attention(q[i : i + 1], gather(k_cache, table[i], n), gather(v_cache, table[i], n),
                        torch.tensor([n - 1], device=DEVICE), scale)  # fmt: skip
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-4, atol=1e-4)


def test_paged_decode_padding_rows_give_zeros_and_bf16():
    kvh, heads, d, bs = 2, 4, 32, 8
    k_cache, v_cache = make_cache(8, bs, kvh, d, dtype=torch.bfloat16)
    table = random_tables([20, 0], bs, 8)
    q = torch.randn(2, heads, d, device=DEVICE, dtype=torch.bfloat16)
    seq_lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    for splits in (1, 4):
        out = triton_attention.paged_decode(q, k_cache, v_cache, table, seq_lens, d**-0.5, splits, block_n=16)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = dense_attention(q[:1], gather(k_cache, table[0], 20), gather(v_cache, table[0], 20),
                        torch.tensor([19], device=DEVICE), d**-0.5)  # fmt: skip
        torch.testing.assert_close(out[:1].float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kvh,heads,d,bs", [(2, 8, 32, 4), (1, 4, 64, 16), (3, 3, 48, 8)])
def test_paged_prefill_prefix_plus_chunk(kvh, heads, d, bs):
    """Chunks with and without a cached prefix, in one flat batch behind two decode rows."""
    chunks = [(0, 9), (5, 12), (bs, 1), (2 * bs + 3, 20), (0, 1)]  # (cached prefix, new tokens)
    lens = [p + n for p, n in chunks]
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    k_cache, v_cache = make_cache(num_blocks, bs, kvh, d)
    table = random_tables(lens, bs, num_blocks)
    num_decodes = 2
    total = num_decodes + sum(n for _, n in chunks)
    q = torch.randn(total, heads, d, device=DEVICE)
    starts = [num_decodes]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, 7.0)
    scale = d**-0.5
    triton_attention.paged_prefill(q, k_cache, v_cache, table, qsl, seq_lens, max(n for _, n in chunks), scale, out,
                                   block_n=16, rows=16)  # fmt: skip
    assert torch.equal(out[:num_decodes], torch.full_like(out[:num_decodes], 7.0))  # rows outside chunks untouched
    for i, (prefix, n) in enumerate(chunks):
        ctx = prefix + n
        s = starts[i]
        ref = dense_attention(q[s : s + n], gather(k_cache, table[i], ctx), gather(v_cache, table[i], ctx),
                        torch.arange(prefix, ctx, device=DEVICE), scale)  # fmt: skip
        torch.testing.assert_close(out[s : s + n], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_window_and_softcap(splits):
    """A sliding window (only the last W keys; the blocks before them hold garbage, as freed blocks do)
    and Gemma 2's soft-capped scores, against the dense oracle with both."""
    kvh, heads, d, bs, window, cap = 2, 8, 32, 4, 10, 2.0
    lens = [1, 9, 10, 11, 37, 70]
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    k_cache, v_cache = make_cache(num_blocks, bs, kvh, d)
    table = random_tables(lens, bs, num_blocks)
    q = torch.randn(len(lens), heads, d, device=DEVICE) * 3  # scores large enough for the cap to bite
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    for i, n in enumerate(lens):  # blocks wholly before the window: nothing they hold may count
        for j in range(max(0, n - window) // bs):
            k_cache[table[i, j]] = 1e4
    out = triton_attention.paged_decode(q, k_cache, v_cache, table, seq_lens, scale, splits, block_n=16,
                                        window=window, softcap=cap)  # fmt: skip
    for i, n in enumerate(lens):
        ref = dense_attention(q[i : i + 1], gather(k_cache, table[i], n), gather(v_cache, table[i], n),
                              torch.tensor([n - 1], device=DEVICE), scale, window=window, softcap=cap)  # fmt: skip
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-4, atol=1e-4)
    plain = triton_attention.paged_decode(q, k_cache, v_cache, table, seq_lens, scale, splits, block_n=16)
    assert not torch.allclose(plain[4:], out[4:], atol=1e-2)  # the window and cap changed something


def test_paged_prefill_window_and_softcap():
    """Prefill chunks behind a cached prefix, each query seeing only its last W positions, scores capped."""
    kvh, heads, d, bs, window, cap = 2, 4, 32, 4, 6, 1.5
    chunks = [(0, 9), (5, 12), (bs, 1), (2 * bs + 3, 20)]
    lens = [p + n for p, n in chunks]
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    k_cache, v_cache = make_cache(num_blocks, bs, kvh, d)
    table = random_tables(lens, bs, num_blocks)
    total = sum(n for _, n in chunks)
    q = torch.randn(total, heads, d, device=DEVICE) * 3
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.zeros_like(q)
    scale = d**-0.5
    triton_attention.paged_prefill(q, k_cache, v_cache, table, qsl, seq_lens, max(n for _, n in chunks), scale, out,
                                   block_n=16, rows=16, window=window, softcap=cap)  # fmt: skip
    for i, (prefix, n) in enumerate(chunks):
        ctx, s = prefix + n, starts[i]
        ref = dense_attention(q[s : s + n], gather(k_cache, table[i], ctx), gather(v_cache, table[i], ctx),
                              torch.arange(prefix, ctx, device=DEVICE), scale, window=window, softcap=cap)  # fmt: skip
        torch.testing.assert_close(out[s : s + n], ref, rtol=1e-4, atol=1e-4)


def test_decode_num_splits_depends_on_shape_only():
    assert triton_attention.decode_num_splits(1, 8, 132) == 16
    assert triton_attention.decode_num_splits(256, 8, 132) == 1
    assert triton_attention.decode_num_splits(4, 8, 132) == 16  # 2 * 132 / 32 programs -> 9 -> 16
    assert triton_attention.decode_num_splits(16, 8, 132) == 4  # 264 / 128 -> 3 -> 4
