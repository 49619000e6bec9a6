"""Mixture-of-experts in Triton: every chosen expert of a step in two launches, no host sync.

`grouped_experts` (layers/moe.py) sorts the (token, choice) pairs by expert on the host and runs one
GEMM pair per expert: a sync per layer and a launch per expert, which rules out CUDA graphs. Here,
as vLLM's fused MoE does:

- `moe_align`: the pairs grouped by expert (stably: by pair index within an expert), each expert's
  run padded to a multiple of BLOCK_M, so that a tile of BLOCK_M rows holds one expert's pairs; per
  tile its expert, and the padded total. Pairs whose expert is not this rank's (expert parallelism)
  go nowhere. Three launches: per chunk of pairs its count per expert (`_align_count_kernel`); in
  one program, each chunk's offset within each expert, the experts' padded starts, every tile's
  expert and the padding (`_align_offsets_kernel`); per chunk, each pair to its row
  (`_align_scatter_kernel`: its rank among its chunk's pairs of the same expert is a cumulative sum
  of one-hot rows). The torch version it replaced (`moe_align_reference`, the tests' reference) took
  ~30 launches a layer; on an H100 a MoE layer cost ~90 us more than its dense twin's MLP at batch 1
  whatever its expert count (2026-11-26), about what that many small kernels take in a graph. Every
  shape depends only on the token count, so a captured graph replays it for any routing.
- `_moe_gemm_kernel`: one program per (row tile, column tile): its tile's expert, the tile's rows
  gathered (for the first GEMM, token = pair // top_k: each token's row is read once per choice),
  dotted with that expert's weight, optionally times each pair's routing weight, scattered back to
  the pairs' rows. Tiles past the padded total return at once.

`fused_experts` runs gate/up (w13), SiLU-and-mul, down (w2, times the weights) and sums each token's
top_k rows. On the CPU the kernels run under TRITON_INTERPRET=1 (tested against grouped_experts).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ferry.kernels.triton_compat import apply_interpreter_numpy_fix

apply_interpreter_numpy_fix()

# The interpreter multiplies 16-bit floats' raw bits in tl.dot (as triton_attention.py notes).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def block_m_for(num_pairs: int, num_experts: int, two_byte: bool = True) -> int:
    """Rows per tile: 16 when the pairs are few per expert (decode: each expert's run is padded to a
    tile, so small tiles waste least), 64 for prompt-sized steps, 128 once the experts average a whole
    such tile (scripts/moe_gemm_sweep.py on an H100, 2026-11-27: DeepSeek-V2-Lite's layer at 2,048
    tokens, 192 pairs an expert, took 710 us with 128-row tiles against 916 with 64) and activations
    are 2-byte (fp32's 128 x 128 tiles ask 196 KB of shared memory: more than Ampere's and Ada's
    99-163 KB)."""
    if num_pairs <= 4 * num_experts:
        return 16
    return 128 if two_byte and num_pairs >= 128 * num_experts else 64


def padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the aligned layout: every routing of `num_pairs` pairs fits (each expert's run padded)."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m


# Elements of the [pairs, experts] one-hot tile an alignment program holds (32 int32s a thread at 8 warps).
_ALIGN_TILE = 8192


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, P, E, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """counts[c, e]: how many of chunk c's pairs chose expert e (ids outside [0, E) match none)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    key = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    e = tl.arange(0, E_PAD)
    hit = (key[:, None] == e[None, :]) & (e[None, :] < E)
    tl.store(counts_ptr + c * E_PAD + e, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _align_offsets_kernel(counts_ptr, offsets_ptr, starts_ptr, pairs_ptr, tile_expert_ptr, num_padded_ptr,
                          num_chunks, P, p_pad, E, E_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                          FILL: tl.constexpr):  # fmt: skip
    """One program: offsets[c, e] = chunk c's first row within expert e's run (the pairs of e in earlier
    chunks); starts[e] = where e's padded run begins; tile_expert for every tile (-1 past the end);
    num_padded; and pairs filled with P, the padding marker, before the scatter writes the pairs."""
    e = tl.arange(0, E_PAD)
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_chunks, ROWS):
        rows = c0 + tl.arange(0, ROWS)
        ok = rows[:, None] < num_chunks
        tile = tl.load(counts_ptr + rows[:, None] * E_PAD + e[None, :], mask=ok, other=0)
        before = tl.cumsum(tile, axis=0) - tile + running[None, :]
        tl.store(offsets_ptr + rows[:, None] * E_PAD + e[None, :], before, mask=ok)
        running += tl.sum(tile, axis=0)
    padded = (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # 0 past E: no pair counts there
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + e, ends - padded)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0).to(tl.int64))
    num_tiles = p_pad // BLOCK_M
    for t0 in range(0, num_tiles, ROWS):
        t = t0 + tl.arange(0, ROWS)
        # a tile's expert: how many runs end at or before its first row (lanes past E end at the total)
        expert = tl.sum((ends[None, :] <= (t * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + t, tl.where(expert < E, expert, -1).to(tl.int64), mask=t < num_tiles)
    for p0 in range(0, p_pad, FILL):
        p = p0 + tl.arange(0, FILL)
        tl.store(pairs_ptr + p, tl.zeros([FILL], dtype=tl.int64) + P, mask=p < p_pad)


@triton.jit
def _align_scatter_kernel(ids_ptr, offsets_ptr, starts_ptr, pairs_ptr, P, E, E_PAD: tl.constexpr,
                          CHUNK: tl.constexpr):  # fmt: skip
    """pairs[row] = pair for chunk c's pairs: row = its expert's start + the chunk's offset in that run +
    its rank among the chunk's pairs of the same expert (a cumulative sum down the one-hot columns)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    key = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    e = tl.arange(0, E_PAD)
    hit = ((key[:, None] == e[None, :]) & (e[None, :] < E)).to(tl.int32)
    rank = tl.sum(hit * tl.cumsum(hit, axis=0), axis=1) - 1
    mine = (offs < P) & (key >= 0) & (key < E)
    expert = tl.where(mine, key, 0)
    row = tl.load(starts_ptr + expert) + tl.load(offsets_ptr + c * E_PAD + expert) + rank
    tl.store(pairs_ptr + row, offs.to(tl.int64), mask=mine)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs of `ids` [T, k] (this rank's expert indices; others outside [0, E))
    grouped by expert, each group padded to a multiple of `block_m`:
    (pairs [P_pad]: a pair index per row, T * k where padding; tile_expert [P_pad / block_m]: the
    expert of each tile, -1 past the end; num_padded [1]: rows in use). P_pad bounds every routing.
    Three launches, no host sync (the module's docstring); the same result as `moe_align_reference`."""
    P, E = ids.numel(), num_experts
    device = ids.device
    flat = ids.reshape(-1).contiguous()  # read as they are (int64 from topk): no conversion launch
    e_pad = max(16, triton.next_power_of_2(E))
    chunk = max(16, min(256, _ALIGN_TILE // e_pad))
    num_chunks = max(1, triton.cdiv(P, chunk))
    p_pad = padded_pairs(P, E, block_m)
    counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)
    starts = torch.empty(e_pad, dtype=torch.int32, device=device)
    pairs = torch.empty(p_pad, dtype=torch.int64, device=device)
    tile_expert = torch.empty(p_pad // block_m, dtype=torch.int64, device=device)
    num_padded = torch.empty(1, dtype=torch.int64, device=device)
    _align_count_kernel[(num_chunks,)](flat, counts, P, E, E_PAD=e_pad, CHUNK=chunk, num_warps=8)
    _align_offsets_kernel[(1,)](counts, offsets, starts, pairs, tile_expert, num_padded, num_chunks, P, p_pad, E,
                                E_PAD=e_pad, ROWS=chunk, BLOCK_M=block_m, FILL=1024, num_warps=8)  # fmt: skip
    _align_scatter_kernel[(num_chunks,)](flat, offsets, starts, pairs, P, E, E_PAD=e_pad, CHUNK=chunk, num_warps=8)
    return pairs, tile_expert, num_padded


def moe_align_reference(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align` in torch ops of fixed shapes (scatter-add counts, a stable sort, cumulative sums):
    the readable statement of what the kernels compute, and the tests' reference."""
    P, E = ids.numel(), num_experts
    device = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < E), flat, E)  # another rank's experts: group E, dropped
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends.new_zeros(1), ends[:-1], ends[-1:]])  # group E (dropped) starts past the end
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    group_first = torch.cumsum(counts, 0) - counts  # where each group begins in sorted order
    rank = torch.arange(P, device=device) - group_first[sorted_key]
    p_pad = padded_pairs(P, E, block_m)
    dest = torch.where(sorted_key < E, starts[sorted_key] + rank, p_pad)  # dropped pairs: a slot cut off below
    pairs = torch.full((p_pad + 1,), P, dtype=torch.int64, device=device).scatter_(0, dest, order)[:p_pad]
    tile_rows = torch.arange(0, p_pad, block_m, device=device)
    tile_expert = torch.searchsorted(ends, tile_rows, right=True)
    tile_expert = torch.where(tile_expert < E, tile_expert, -1)
    return pairs, tile_expert, ends[-1:]


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    tile_expert_ptr,
    num_padded_ptr,
    weight_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    ROWS_ARE_TOKENS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    tile = pid // num_n
    col = pid % num_n
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    m_ok = pair < num_pairs
    if ROWS_ARE_TOKENS:
        row = pair // TOP_K
    else:
        row = pair
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + row[:, None] * stride_am + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # fmt: skip
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=m_ok, other=0.0)[:, None]
    dst = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm_tiles(K: int, block_m: int = 64) -> dict[str, int]:
    """The GEMM's tiles besides BLOCK_M (`block_m_for`), 4 warps and 3 stages. The best of
    scripts/moe_gemm_sweep.py's on an H100 (2026-11-27) where it timed them: decode's 16-row tiles step K
    by 128 (DeepSeek-V2-Lite's and Qwen3-30B-A3B's layers at one token: 60 and 52 us against 64 and 56
    with 64), 128-row tiles take 128 output columns (DeepSeek-V2-Lite's at 2,048 tokens: 710 us against
    916 for 64 x 64 tiles); otherwise 64 columns and K in steps of 64 (32 where K is not a multiple of
    64), untimed against others."""
    if block_m <= 32 and K % 128 == 0:
        return {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if block_m >= 128:
        return {"BLOCK_N": 128, "BLOCK_K": 32 if K % 64 else 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 64, "BLOCK_K": 32 if K % 64 else 64, "num_warps": 4, "num_stages": 3}


def moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    top_k: int,
    block_m: int,
    rows_are_tokens: bool,
    weights: torch.Tensor | None = None,
    tiles: dict[str, int] | None = None,
) -> torch.Tensor:
    """out[pair] = a[row(pair)] @ w[expert(pair)].T (times weights[pair]), for the pairs `aligned` lists;
    a [rows, K], w [E, N, K], out [T * top_k, N]; row = pair // top_k when `rows_are_tokens`. `tiles`:
    gemm_tiles' keys (default: gemm_tiles(K, block_m))."""
    pairs, tile_expert, num_padded = aligned
    E, N, K = w.shape
    if a.stride(-1) != 1:
        a = a.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    t = tiles or gemm_tiles(K, block_m)
    grid = (tile_expert.numel() * triton.cdiv(N, t["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a, w, out, pairs, tile_expert, num_padded, weights if weights is not None else out,
        N, K, out.shape[0], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, ROWS_ARE_TOKENS=rows_are_tokens, MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m, BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], DOT_F32=_INTERPRETED or a.dtype == torch.float32,
        num_warps=t["num_warps"], num_stages=t["num_stages"],
    )  # fmt: skip
    return out


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up: the fused Triton kernel on CUDA, torch elsewhere (the interpreted tests)."""
    if gate_up.is_cuda:
        from ferry.kernels.triton_fused import silu_and_mul

        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    block_m: int | None = None, tiles: tuple[dict[str, int], dict[str, int]] | None = None,
    experts_in_layer: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]): w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I],
    x [T, H], weights / ids [T, k] (ids outside [0, E): no contribution). Returns [T, H] in x's dtype.
    `block_m` and `tiles` (the gate/up GEMM's, then the down GEMM's) override the defaults (the sweep).
    `experts_in_layer`: the layer's experts on all ranks under expert parallelism (E is this rank's):
    the T k pairs spread over those, so an expert's expected share, which picks the tiles, is T k over
    them, not over E (counted over E, 8 ranks took 128-row tiles for ~16 pairs an expert)."""
    T, H = x.shape
    E, k = w13.shape[0], ids.shape[1]
    block_m = block_m or block_m_for(T * k, experts_in_layer or E, x.element_size() <= 2)
    tiles13, tiles2 = tiles or (None, None)
    aligned = moe_align(ids, E, block_m)
    gate_up = moe_gemm(x, w13, torch.empty(T * k, w13.shape[1], dtype=x.dtype, device=x.device), aligned, k,
                       block_m, rows_are_tokens=True, tiles=tiles13)  # fmt: skip
    h = _silu_and_mul(gate_up)  # rows of dropped pairs hold whatever was there: never read below
    out = torch.zeros(T * k, H, dtype=x.dtype, device=x.device)  # dropped pairs add nothing
    moe_gemm(h, w2, out, aligned, k, block_m, rows_are_tokens=False, weights=weights.reshape(-1).float(),
             tiles=tiles2)  # fmt: skip
    return out.view(T, k, H).sum(dim=1)
