"""GGUF block-quantized weights executed as stored (ferry/kernels/csrc/gguf_quant_cpu.cpp) against
gguf-py's dequantizer, the reference implementation of ggml's block formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from ferry.layers.gguf_linear import (
    GEMM_MIN_ROWS,
    GGUF_QUANT_TYPES,
    INT8_PROMPT_TYPES,
    GGUFWeight,
    exact_prompt_rows,
    gguf_embedding,
    gguf_linear,
)
from tests.conftest import outputs_of_both_cpu_builds

pytestmark = pytest.mark.skipif(
    not __import__("ferry.layers.gguf_linear", fromlist=["gguf_available"]).gguf_available(),
    reason="no C++ compiler for the CPU kernels",
)

N, K = 72, 512  # two K-quant super-blocks, 16 32-blocks per row


def _k_quant_blocks(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with sane scales (gguf-py cannot quantize K-quants): every byte of
    quants and sub-block scales random, the fp16 super-scales small and positive."""
    _, _, block_bytes = GGUF_QUANT_TYPES[type_name]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    d = np.full(n_blocks, 0.01, np.float16).view(np.uint8).reshape(n_blocks, 2)
    dmin = np.full(n_blocks, 0.004, np.float16).view(np.uint8).reshape(n_blocks, 2)
    if type_name == "Q6_K":
        raw[:, 208:210] = d
    else:
        raw[:, 0:2], raw[:, 2:4] = d, dmin
    return raw


def _weight(type_name: str) -> tuple[GGUFWeight, torch.Tensor]:
    """(the kernel's weight, gguf-py's fp32 dequantization of the same bytes)."""
    rng = np.random.default_rng(0)
    qtype = GGMLQuantizationType[type_name]
    if type_name.endswith("_K"):
        raw = _k_quant_blocks(type_name, N * K // 256, rng).reshape(N, -1)
    else:
        raw = quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)
    reference = torch.from_numpy(dequantize(raw, qtype).astype(np.float32).reshape(N, K))
    return GGUFWeight.from_numpy(raw, type_name, (N, K)), reference


@pytest.mark.parametrize("type_name", list(GGUF_QUANT_TYPES))
def test_dequantize_and_rows_match_ggml(type_name):
    w, reference = _weight(type_name)
    assert (
        w.data.dtype == torch.uint8
        and w.nbytes == N * K // GGUF_QUANT_TYPES[type_name][1] * GGUF_QUANT_TYPES[type_name][2]
    )
    torch.testing.assert_close(w.dequantize(), reference, rtol=0, atol=0)
    ids = torch.tensor([[5, 0], [71, 5]])
    torch.testing.assert_close(gguf_embedding(ids, w), reference[ids], rtol=0, atol=0)
    # A row selection (the loader's Q/K unpermutation) moves whole rows.
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(w.rows(order).dequantize(), reference[order], rtol=0, atol=0)


@pytest.mark.parametrize("type_name", list(GGUF_QUANT_TYPES))
@pytest.mark.parametrize("rows", [1, 3, 6, GEMM_MIN_ROWS + 5])
def test_matmul_matches_the_dequantized_weight(type_name, rows):
    w, reference = _weight(type_name)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N)
    y = gguf_linear(x, [w], bias)
    expected = x @ reference.T + bias
    rel = ((y - expected).norm() / expected.norm()).item()
    int8_prompts = w.qtype in INT8_PROMPT_TYPES
    if rows >= GEMM_MIN_ROWS and not int8_prompts:  # K-quants: dequantize + fp32 GEMM
        assert rel < 1e-5
    else:  # activations quantized to int8 per 32 values, as llama.cpp does: ~0.5% per matmul
        assert 1e-5 < rel < 0.02
    with exact_prompt_rows():  # the reference path, which K-quant prompts take, for every type
        y = gguf_linear(x, [w], bias)
    rel = ((y - expected).norm() / expected.norm()).item()
    assert rel < 1e-5 if rows >= GEMM_MIN_ROWS else 1e-5 < rel < 0.02


@pytest.mark.parametrize("type_name", list(GGUF_QUANT_TYPES))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(type_name):
    """The int8-dot kernel takes activation rows 1 to 4 at a time, each with its own accumulators and
    op order: a row's output is the same bits alone, in any batch and on any thread count. A prompt
    then computes the same K/V however it is chunked, and decode the same at any batch."""
    from ferry.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if type_name.endswith("_K"):
        w, _ = _weight(type_name)
    else:  # 43 rows: 5 interleaved groups and 3 plain rows; 18 blocks: a tail past 8-block steps
        n, k = 43, 576
        values = np.random.default_rng(6).standard_normal((n, k)).astype(np.float32)
        raw = quantize(values, GGMLQuantizationType[type_name])
        w = GGUFWeight.from_numpy(raw, type_name, (n, k))
    w = w.interleave()
    # 37 rows: more than a prompt block (32), so the batch takes the tiles, and its rows are quantized
    # by the threads in shares (quantize_q8_rows); one row alone takes neither
    x = torch.randn(37, w.in_features, generator=torch.Generator().manual_seed(5))
    y = kernels.gguf_linear(x, w.data, w.qtype, None)
    for r in range(len(x)):
        assert torch.equal(kernels.gguf_linear(x[r : r + 1], w.data, w.qtype, None)[0], y[r]), r
    for start in (1, 2, 3, 5):
        assert torch.equal(kernels.gguf_linear(x[start:], w.data, w.qtype, None), y[start:]), start
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):  # one thread quantizes every row; three on two cores, oversubscribed
            torch.set_num_threads(n)
            assert torch.equal(kernels.gguf_linear(x, w.data, w.qtype, None), y), n
    finally:
        torch.set_num_threads(threads)


def test_parts_of_different_types_stack_by_rows():
    (a, ra), (b, rb), (c, rc) = (_weight(t) for t in ("Q4_1", "Q4_1", "Q6_K"))
    x = torch.randn(2, K)
    y = gguf_linear(x, [a, b, c], None)
    expected = x @ torch.cat([ra, rb, rc]).T
    assert ((y - expected).norm() / expected.norm()).item() < 0.02


def test_bad_shapes_are_refused():
    w, _ = _weight("Q4_1")
    with pytest.raises(RuntimeError, match="bytes, expected"):
        gguf_linear(torch.randn(1, K + 32), [w], None)
    with pytest.raises(RuntimeError, match="out of range"):
        gguf_embedding(torch.tensor([N]), w)
    with pytest.raises(ValueError, match="whole blocks"):
        GGUFWeight.from_numpy(np.zeros((1, 18), np.uint8), "Q4_0", (1, 40))


@pytest.mark.parametrize("type_name", list(GGUF_QUANT_TYPES))
def test_column_shards_and_padded_rows_are_the_same_blocks(type_name):
    """Tensor parallelism's shards, still quantized: a row-parallel rank's input columns (whole blocks,
    the file's bytes) and a vocab shard padded with zero rows; anything but whole blocks is refused."""
    w, reference = _weight(type_name)
    block = GGUF_QUANT_TYPES[type_name][1]
    for start, stop in ((0, K // 2), (K // 2, K), (0, K), (block, 2 * block)):
        part = w.columns(start, stop)
        assert part.in_features == stop - start and part.nbytes * K == w.nbytes * (stop - start)
        torch.testing.assert_close(part.dequantize(), reference[:, start:stop], rtol=0, atol=0)
    halves = [w.columns(0, K // 2), w.columns(K // 2, K)]
    x = torch.randn(3, K)
    y = sum(gguf_linear(x[:, i * K // 2 : (i + 1) * K // 2], [h], None) for i, h in enumerate(halves))
    torch.testing.assert_close(y, gguf_linear(x, [w], None), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="whole blocks"):
        w.columns(0, block // 2)
    padded = w.rows(slice(N - 5, N)).padded_rows(8)
    assert padded.out_features == 8
    torch.testing.assert_close(padded.dequantize()[:5], reference[N - 5 :], rtol=0, atol=0)
    assert torch.count_nonzero(padded.dequantize()[5:]) == 0


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [512, 576])  # 576: 18 blocks, not a multiple of the plain kernel's 8
def test_interleaved_by_eight_rows(type_name, k):
    """On the CPU, Q4_0/Q4_1/Q8_0 run interleaved by 8 rows (rows past the last group stay plain): the
    same bytes and values, dot products with one rounding order per row whatever the batch or the
    thread split, and no row selection or move off the CPU once interleaved."""
    n = 8 * 5 + 3
    raw = quantize(np.random.default_rng(1).standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[type_name])
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32).reshape(n, k))
    plain = GGUFWeight.from_numpy(raw, type_name, (n, k))
    w = plain.interleave()
    assert w.interleaved and w.qtype == plain.qtype + 256 and w.type_name == type_name + "x8"
    assert w.nbytes == plain.nbytes and not torch.equal(w.data, plain.data)
    assert w.interleave() is w
    torch.testing.assert_close(w.dequantize(), reference, rtol=0, atol=0)
    ids = torch.tensor([0, 7, 8, 39, 40, 42])  # group edges and the plain tail
    torch.testing.assert_close(gguf_embedding(ids, w), reference[ids], rtol=0, atol=0)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2))
    y = gguf_linear(x, [w], None)
    expected = x @ reference.T
    assert 1e-5 < ((y - expected).norm() / expected.norm()).item() < 0.02
    torch.testing.assert_close(y, gguf_linear(x, [plain], None), rtol=1e-4, atol=1e-4)
    grouped = slice(0, 40)
    for r in range(6):  # alone, each activation row gets the same grouped outputs as in the batch
        assert torch.equal(gguf_linear(x[r : r + 1], [w], None)[0, grouped], y[r, grouped])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gguf_linear(x, [w], None)[:, grouped], y[:, grouped])
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="cannot be selected"):
        w.rows(torch.arange(n))
    with pytest.raises(ValueError, match="cannot move off the CPU"):
        w.to("meta")


_ISA_SCRIPT = r"""
import sys, numpy as np, torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from ferry.kernels.cpu import cpu_kernels
from ferry.layers.gguf_linear import GGUFWeight

torch.set_num_threads(2)
out = {}
for type_name, interleave in (("Q8_0", False), ("Q8_0", True), ("Q4_0", True), ("Q4_1", True)):
    k = 576  # 18 blocks: two whole groups of 8 and a tail of 2
    raw = quantize(np.random.default_rng(3).standard_normal((8 * 5 + 3, k)).astype(np.float32),
                   GGMLQuantizationType[type_name])
    w = GGUFWeight.from_numpy(raw, type_name, (8 * 5 + 3, k))
    w = w.interleave() if interleave else w  # 43 rows: 5 groups of 8 and 3 plain rows
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    for rows in range(1, 6):  # 1..4 activation rows per pass, and 4 + 1
        out[f"{w.type_name} {rows}"] = cpu_kernels().gguf_linear(x[:rows], w.data, w.qtype, None)
for type_name, block_bytes in (("Q4_K", 144), ("Q5_K", 176), ("Q6_K", 210)):
    n, k = 9, 512  # random super-blocks (gguf-py cannot quantize K-quants), small positive fp16 scales
    raw = np.random.default_rng(5).integers(0, 256, size=(n * k // 256, block_bytes), dtype=np.uint8)
    scale = np.full(len(raw), 0.01, np.float16).view(np.uint8).reshape(-1, 2)
    if type_name == "Q6_K":
        raw[:, 208:210] = scale
    else:
        raw[:, 0:2], raw[:, 2:4] = scale, scale
    w = GGUFWeight.from_numpy(raw.reshape(n, -1), type_name, (n, k))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    for rows in range(1, 6):
        out[f"{type_name} {rows}"] = cpu_kernels().gguf_linear(x[:rows], w.data, w.qtype, None)
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(
    "avx512_vnni" not in __import__("ferry.kernels.cpu", fromlist=["cpu_flags"]).cpu_flags(),
    reason="without AVX-512 VNNI the native build is the AVX2 build",
)
def test_avx512_vnni_and_avx2_builds_agree(tmp_path):
    """This CPU runs the VNNI kernels (interleaved Q4/Q8_0 groups, Q8_0 rows, K-quant super-blocks); the
    AVX2 ones, built with FERRY_CPU_ISA=avx2, take the same integer dots in another float order: the
    same outputs to fp32 rounding, for every count of activation rows a pass takes, whole groups of
    8 blocks and a tail."""
    avx2, native = outputs_of_both_cpu_builds(_ISA_SCRIPT, tmp_path)
    assert set(native) == set(avx2) and len(native) == 35
    for case, y in native.items():
        torch.testing.assert_close(y, avx2[case], rtol=1e-5, atol=1e-5, msg=case)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_prompts_rows_in_a_large_weight(type_name):
    """A prompt's 70 rows against 2,403 weight rows of 576 values, through gguf_prompt_cpu.cpp's tiles
    (32-row blocks over ~256 KB chunks of groups: a thread's share is two chunks; then the plain rows
    at the end): every output equals the row's own result alone, bit for bit, and the plain layout's
    to rounding."""
    from ferry.kernels.cpu import cpu_kernels

    n, k = 8 * 300 + 3, 576
    raw = quantize(np.random.default_rng(3).standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[type_name])
    plain = GGUFWeight.from_numpy(raw, type_name, (n, k))
    w = plain.interleave()
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    y = cpu_kernels().gguf_linear(x, w.data, w.qtype, None)
    for r in (0, 7, 31, 32, 33, 63, 64, 69):
        assert torch.equal(cpu_kernels().gguf_linear(x[r : r + 1], w.data, w.qtype, None)[0], y[r]), r
    torch.testing.assert_close(y, cpu_kernels().gguf_linear(x, plain.data, plain.qtype, None), rtol=1e-4, atol=1e-4)
