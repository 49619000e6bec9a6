"""The fused-MoE Triton kernels (interpreted on the CPU) against grouped_experts, the reference."""

from __future__ import annotations

import pytest
import torch

from ferry.layers.moe import grouped_experts, select_experts

triton_moe = pytest.importorskip("ferry.kernels.triton_moe")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def experts(E: int, H: int, inter: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.2).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.2).to(DEVICE, dtype)
    return w13, w2


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 8, 2), (64, 8, 3), (5, 16, 4), (256, 4, 2)])
def test_fused_experts_match_grouped_experts(T, E, k):
    """Decode-sized (16-row tiles), prompt-sized (64) and, at 128 pairs an expert, 128-row tiles."""
    H, inter = 64, 48  # K of the down GEMM (48) not a multiple of the 32-wide k tile... of 64: both paths
    w13, w2 = experts(E, H, inter)
    x = torch.randn(T, H, device=DEVICE)
    weights, ids = select_experts(torch.randn(T, E, device=DEVICE), k, renormalize=True)
    ref = grouped_experts(x, w13, w2, weights, ids)
    got = triton_moe.fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_other_tiles_give_the_same_experts():
    """The tiles scripts/moe_gemm_sweep.py tries (another BLOCK_M for the alignment and both GEMMs, each
    GEMM's own BLOCK_N / BLOCK_K) compute the same layer."""
    T, E, k, H, inter = 37, 8, 2, 64, 96
    w13, w2 = experts(E, H, inter, seed=3)
    x = torch.randn(T, H, device=DEVICE)
    weights, ids = select_experts(torch.randn(T, E, device=DEVICE), k, renormalize=True)
    ref = grouped_experts(x, w13, w2, weights, ids)
    for block_m, n, kk in ((32, 32, 32), (16, 128, 64)):
        tiles = {"BLOCK_N": n, "BLOCK_K": kk, "num_warps": 8, "num_stages": 4}
        got = triton_moe.fused_experts(
            x, w13, w2, weights, ids, block_m, (tiles, triton_moe.gemm_tiles(inter, block_m))
        )
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_default_tiles_follow_the_pairs_per_expert():
    """block_m_for / gemm_tiles pick by pairs an expert; decode's K steps of 128 where K allows them."""
    assert [triton_moe.block_m_for(p, 8) for p in (1, 32, 33, 1023, 1024)] == [16, 16, 64, 64, 128]
    assert triton_moe.block_m_for(1024, 8, two_byte=False) == 64  # fp32: 128 x 128 tiles outgrow shared memory
    assert triton_moe.gemm_tiles(2048, 16)["BLOCK_K"] == 128 and triton_moe.gemm_tiles(1408, 16)["BLOCK_K"] == 128
    assert triton_moe.gemm_tiles(48, 16)["BLOCK_K"] == 32  # K not a multiple of 128 (nor 64)
    assert triton_moe.gemm_tiles(2048, 128)["BLOCK_N"] == 128 and triton_moe.gemm_tiles(2048, 64)["BLOCK_N"] == 64
    T, E, k, H, inter = 3, 8, 2, 128, 64  # decode: the gate/up GEMM (K = 128) steps K by 128
    w13, w2 = experts(E, H, inter, seed=5)
    x = torch.randn(T, H, device=DEVICE)
    weights, ids = select_experts(torch.randn(T, E, device=DEVICE), k, renormalize=True)
    torch.testing.assert_close(triton_moe.fused_experts(x, w13, w2, weights, ids),
                               grouped_experts(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)  # fmt: skip


def test_other_ranks_experts_add_nothing():
    """Expert parallelism: ids outside [0, E) are another rank's; only this rank's pairs count."""
    T, E, k, H, inter = 9, 4, 2, 32, 32
    w13, w2 = experts(E, H, inter, seed=1)
    x = torch.randn(T, H, device=DEVICE)
    weights, ids = select_experts(torch.randn(T, 2 * E, device=DEVICE), k, renormalize=False)
    local = ids - E // 2  # this rank holds global experts 2..5 as 0..3
    ref = grouped_experts(x, w13, w2, weights, local)
    got = triton_moe.fused_experts(x, w13, w2, weights, local)
    assert ((local < 0) | (local >= E)).any() and ((local >= 0) & (local < E)).any()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_expert_parallel_tiles_count_the_layers_experts(monkeypatch):
    """Under expert parallelism a rank's share of the pairs is what sizes its tiles: 128 pairs over
    a layer of 32 experts are 4 an expert (decode's 16-row tiles), whether this rank holds 4 of them
    or all 32."""
    T, k, H, inter = 64, 2, 32, 32
    w13, w2 = experts(4, H, inter, seed=6)
    x = torch.randn(T, H, device=DEVICE)
    weights, ids = select_experts(torch.randn(T, 32, device=DEVICE), k, renormalize=False)
    local = ids - 8  # this rank holds global experts 8..11 as 0..3
    chosen = []
    align = triton_moe.moe_align
    monkeypatch.setattr(
        triton_moe, "moe_align", lambda ids, E, block_m: chosen.append(block_m) or align(ids, E, block_m)
    )
    got = triton_moe.fused_experts(x, w13, w2, weights, local, experts_in_layer=32)
    assert chosen == [triton_moe.block_m_for(T * k, 32)] == [16]
    triton_moe.fused_experts(x, w13, w2, weights, local)  # counted over this rank's 4: 32 an expert
    assert chosen[1] == 64
    torch.testing.assert_close(got, grouped_experts(x, w13, w2, weights, local), rtol=1e-4, atol=1e-4)


def test_bf16_experts():
    T, E, k, H, inter = 6, 8, 2, 64, 64
    w13, w2 = experts(E, H, inter, dtype=torch.bfloat16, seed=2)
    x = torch.randn(T, H, device=DEVICE).bfloat16()
    weights, ids = select_experts(torch.randn(T, E, device=DEVICE), k, renormalize=True)
    ref = grouped_experts(x.float(), w13.float(), w2.float(), weights, ids)
    got = triton_moe.fused_experts(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=3e-2, atol=3e-2)


def test_moe_align_groups_pairs_by_expert_in_padded_tiles():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [9, 3]], device=DEVICE)  # expert 9: another rank's
    pairs, tile_expert, num_padded = triton_moe.moe_align(ids, 4, block_m=2)
    P = ids.numel()
    used = pairs[: int(num_padded)].tolist()
    # expert 0: pairs 1, 4; expert 1: pair 3 (+ padding); expert 3: pairs 0, 2, 5, 7 (in order); pair 6 dropped
    assert used == [1, 4, 3, P, 0, 2, 5, 7]
    assert tile_expert.tolist()[:4] == [0, 1, 3, 3] and set(tile_expert.tolist()[4:]) <= {-1}
    assert pairs.numel() >= P + 4 * (2 - 1) and set(pairs[int(num_padded) :].tolist()) <= {P}


@pytest.mark.parametrize("seed", range(6))
def test_moe_align_kernels_match_the_torch_reference(seed):
    """The three alignment launches give exactly the torch reference's layout, for expert counts that
    are and are not powers of two, more chunks of pairs than one pass of the offsets loop, and other
    ranks' experts."""
    g = torch.Generator().manual_seed(seed)
    # (600, 8, 128): 75 chunks of 64 pairs, more than the offsets kernel takes in one pass of its loop
    for T, k, E, block_m in ((1, 2, 8, 16), (37, 6, 64, 16), (600, 8, 128, 64), (45, 3, 130, 16), (129, 4, 3, 64)):
        ids = torch.randint(0, E, (T, k), generator=g)
        if seed % 2:  # expert parallelism: ids outside [0, E) are another rank's
            ids = ids - E // 3
            ids[ids % 5 == 0] = E + 2
        ids = ids.to(DEVICE)
        got, ref = triton_moe.moe_align(ids, E, block_m), triton_moe.moe_align_reference(ids, E, block_m)
        for g_t, r_t in zip(got, ref):
            assert g_t.dtype == r_t.dtype and torch.equal(g_t, r_t), (T, k, E, block_m)
