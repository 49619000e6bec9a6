"""The compiled CPU decode kernel against the torch reference path, on random paged caches."""

import shutil

import numpy as np
import pytest
import torch

from ferry.kernels.cpu import cpu_flags, embeds_its_own_libstdcxx
from ferry.kv_quant import KEYS, VALUES, blocks_of_rows, quantize_blocks, rows_of_blocks
from ferry.layers.attention import TorchAttentionBackend, build_metadata, paged_attention
from tests.conftest import outputs_of_both_cpu_builds


def dense(q, k_cache, v_cache, table_row, n):
    """Attention of one sequence's q [H, D] to its n tokens' K/V, gathered from the paged caches."""
    bs, g, d = k_cache.shape[1], q.shape[0] // k_cache.shape[2], q.shape[-1]
    slots = torch.arange(n)
    blocks = table_row[slots // bs]
    kk = k_cache[blocks, slots % bs].float().repeat_interleave(g, dim=1).transpose(0, 1)  # [H, n, D]
    vv = v_cache[blocks, slots % bs].float().repeat_interleave(g, dim=1).transpose(0, 1)
    p = torch.softmax((q.unsqueeze(1) @ kk.transpose(1, 2)) * d**-0.5, dim=-1)
    return (p @ vv).squeeze(1)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4), (6, 1), (4, 2), (10, 2), (8, 1)])
@pytest.mark.parametrize("bs", [4, 16])
def test_decode_kernel_matches_reference(kernels, heads, kv_heads, cache_dtype, bs):
    """A bf16 cache is widened exactly, so it matches the fp32 math on the same (rounded) values.
    With AVX-512 the G query heads of a kv head go through in passes of up to three (G = 1, 2, 4 as
    2 + 2, 5 as 3 + 2, 6, 8 as 3 + 3 + 2), 8 keys at a time (16-token blocks) or one by one."""
    torch.manual_seed(0)
    nb, d = 40, 32
    k_cache = torch.randn(nb, bs, kv_heads, d).to(cache_dtype)
    v_cache = torch.randn(nb, bs, kv_heads, d).to(cache_dtype)
    lens = torch.tensor([1, 5, 16, 9 if bs == 4 else 45])
    perm = torch.randperm(nb)
    table = torch.zeros(4, 4, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens.tolist()):
        nblk = -(-n // bs)
        table[i, :nblk] = perm[used : used + nblk]
        used += nblk
    q = torch.randn(4, heads, d)
    got = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, d**-0.5)
    for i, n in enumerate(lens.tolist()):
        torch.testing.assert_close(got[i], dense(q[i], k_cache, v_cache, table[i], n), rtol=1e-5, atol=1e-5)


def test_decode_kernel_splits_long_sequences(kernels):
    """Sequences longer than one partition (64 tokens) are attended in parts merged by their
    softmax maxima; the result matches dense attention and does not depend on the batch."""
    torch.manual_seed(3)
    nb, bs, kvh, heads, d = 64, 16, 3, 9, 64
    k_cache, v_cache = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
    lens = torch.tensor([200, 1, 64, 65, 129])
    table = torch.zeros(len(lens), 16, dtype=torch.long)
    perm, used = torch.randperm(nb), 0
    for i, n in enumerate(lens.tolist()):
        nblk = -(-n // bs)
        table[i, :nblk] = perm[used : used + nblk]
        used += nblk
    q = torch.randn(len(lens), heads, d) * 3  # peaked softmaxes: the partitions' maxima differ
    got = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, d**-0.5)
    for i, n in enumerate(lens.tolist()):
        torch.testing.assert_close(got[i], dense(q[i], k_cache, v_cache, table[i], n), rtol=1e-5, atol=1e-5)
        one = slice(i, i + 1)
        alone = kernels.paged_decode_attention(q[one], k_cache, v_cache, table[one], lens[one], d**-0.5)
        assert torch.equal(alone[0], got[i])


def dense_at(q, k_cache, v_cache, table_row, positions):
    """Attention of q [H, D] to the K/V at the given positions only (gathered from the caches)."""
    bs, g, d = k_cache.shape[1], q.shape[0] // k_cache.shape[2], q.shape[-1]
    slots = torch.tensor(positions)
    blocks = table_row[slots // bs]
    kk = k_cache[blocks, slots % bs].float().repeat_interleave(g, dim=1).transpose(0, 1)
    vv = v_cache[blocks, slots % bs].float().repeat_interleave(g, dim=1).transpose(0, 1)
    p = torch.softmax((q.unsqueeze(1) @ kk.transpose(1, 2)) * d**-0.5, dim=-1)
    return (p @ vv).squeeze(1)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("start", [5, 62, 70])
def test_decode_kernel_tree_rows_are_plain_rows_over_their_path(kernels, cache_dtype, start):
    """Tree verification: a row attends to the positions before `start` and, from there to its own,
    only to those whose bit is set, as if they were consecutive: bit for bit what a plain decode row
    computes over a cache holding that path in order (the int8 dots downstream turn any rounding
    difference into a different token). A partition boundary (64 tokens) may cut the tree. The
    torch path's mask agrees to rounding; rows without a tree (start = their length) are plain."""
    torch.manual_seed(4)
    nb, bs, kvh, heads, d = 24, 16, 2, 6, 32
    if cache_dtype == torch.int8:
        k_cache = quantize_blocks(torch.randn(nb, bs, kvh, d), torch.int8, KEYS)
        v_cache = quantize_blocks(torch.randn(nb, bs, kvh, d), torch.int8, VALUES)
    else:
        k_cache = torch.randn(nb, bs, kvh, d).to(cache_dtype)
        v_cache = torch.randn(nb, bs, kvh, d).to(cache_dtype)
    table = torch.randperm(nb)[:8].unsqueeze(0).repeat(5, 1)
    # Drafts 1..4 at start..start+3: 1 and 2 children of the root, 3 of 1, 4 of 3.
    ancestors = {0: [], 1: [1], 2: [2], 3: [1, 3], 4: [1, 3, 4]}
    lens, tree, visible = [], [], []
    for row, chain in ancestors.items():
        n = start + row
        lens.append(n)
        tree.append((start, sum(1 << (a - 1) for a in chain)))
        visible.append(list(range(start)) + [start + a - 1 for a in chain])
    lens, tree = torch.tensor(lens), torch.tensor(tree)
    q = torch.randn(5, heads, d) * 2
    got = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, d**-0.5, tree)
    blocks = table[0]
    for i in range(5):
        path, at = torch.tensor(visible[i]), torch.arange(len(visible[i]))
        src, dst = blocks[path // bs] * bs + path % bs, blocks[at // bs] * bs + at % bs
        # the path's rows at consecutive positions
        k_plain, v_plain = rows_of_blocks(k_cache, KEYS).clone(), rows_of_blocks(v_cache, VALUES).clone()
        w = k_cache.shape[-1]
        k_plain.view(-1, kvh, w)[dst] = k_plain.view(-1, kvh, w)[src]
        v_plain.view(-1, kvh, w)[dst] = v_plain.view(-1, kvh, w)[src]
        k_plain, v_plain = blocks_of_rows(k_plain, KEYS), blocks_of_rows(v_plain, VALUES)
        plain_row = kernels.paged_decode_attention(q[i : i + 1], k_plain, v_plain, table[i : i + 1],
                                                   torch.tensor([len(path)]), d**-0.5)  # fmt: skip
        assert torch.equal(got[i], plain_row[0])
        if cache_dtype != torch.int8:
            torch.testing.assert_close(
                got[i], dense_at(q[i], k_cache, v_cache, table[i], visible[i]), rtol=1e-5, atol=1e-5
            )
    plain = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, d**-0.5, torch.stack([lens, 0 * lens], 1))
    assert torch.equal(plain, kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, d**-0.5))

    if cache_dtype == torch.int8:
        return
    torch_backend = TorchAttentionBackend(torch.device("cpu"), use_cpu_kernel=False)
    spare = next(b for b in range(nb) if b not in table[0].tolist())  # the rows' own K/V go there, unread
    meta = build_metadata(
        slot_mapping=spare * bs + np.arange(5), block_size=bs, decode_blocks=[t.numpy() for t in table],
        decode_seq_lens=lens.numpy(), prefills=[], device=torch.device("cpu"), backend=torch_backend,
        decode_tree=tree.numpy(),
    )  # fmt: skip
    ref = torch_backend.forward(q, q[:, :kvh], q[:, :kvh], k_cache, v_cache, meta, d**-0.5)
    torch.testing.assert_close(ref, got, rtol=1e-5, atol=1e-5)


def as_cache(x, cache_dtype, layout):
    """fp32 K or V blocks as a cache of cache_dtype: int8 quantized in the kernel's block layout."""
    return quantize_blocks(x, torch.int8, layout) if cache_dtype == torch.int8 else x.to(cache_dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_large_batch_merges_each_sequence_in_its_thread(kernels, cache_dtype):
    """In a batch of many sequences a thread claims whole sequences and merges their partitions as
    it finishes each; a sequence alone is split into partitions merged after all are done. Both
    merge the same partitions in the same order, so each result is bit-identical either way (and
    with fp32 rows matches dense attention)."""
    gen = torch.Generator().manual_seed(11)
    bs, kvh, heads, d, batch = 16, 3, 9, 64, 64
    lens = torch.randint(130, 260, (batch,), generator=gen)  # 3 to 5 partitions each
    lens[:4] = torch.tensor([1, 64, 65, 300])
    per_seq = -(-int(lens.max()) // bs)
    nb = batch * per_seq
    k, v = torch.randn(nb, bs, kvh, d, generator=gen), torch.randn(nb, bs, kvh, d, generator=gen)
    k_cache, v_cache = as_cache(k, cache_dtype, KEYS), as_cache(v, cache_dtype, VALUES)
    table = torch.randperm(nb, generator=gen).view(batch, per_seq)
    q = torch.randn(batch, heads, d, generator=gen) * 3  # peaked softmaxes: the partitions' maxima differ
    got = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, d**-0.5)
    for i, n in enumerate(lens.tolist()):
        one = slice(i, i + 1)
        alone = kernels.paged_decode_attention(q[one], k_cache, v_cache, table[one], lens[one], d**-0.5)
        assert torch.equal(alone[0], got[i]), f"sequence {i} of {n} tokens"
        if cache_dtype == torch.float32:
            torch.testing.assert_close(got[i], dense(q[i], k, v, table[i], n), rtol=1e-5, atol=1e-5)


def test_partials_beyond_the_kept_buffers(kernels):
    """A split sequence's partitions leave their partials in the calling thread's buffers, kept from
    call to call up to 1 MB and released after a call that needed more (a sequence of 30,000 tokens
    with SmolLM2's heads needs ~1.1 MB): calls before, between and after such calls, on buffers
    kept, released and grown again, give the same results, and the long one matches dense attention."""
    gen = torch.Generator().manual_seed(8)
    bs, kvh, heads, d = 16, 3, 9, 64
    long, short = 30_000, 300
    nb = -(-long // bs) + -(-short // bs)
    k_cache, v_cache = torch.randn(nb, bs, kvh, d, generator=gen), torch.randn(nb, bs, kvh, d, generator=gen)
    order = torch.randperm(nb, generator=gen)
    table_long = order[: -(-long // bs)].view(1, -1)
    table_short = order[-(-long // bs) :].view(1, -1)
    q = torch.randn(1, heads, d, generator=gen) * 3

    def attend(table, n):
        return kernels.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([n]), d**-0.5)

    short_first, long_first = attend(table_short, short), attend(table_long, long)
    assert torch.equal(attend(table_short, short), short_first)
    assert torch.equal(attend(table_long, long), long_first)
    torch.testing.assert_close(long_first[0], dense(q[0], k_cache, v_cache, table_long[0], long), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        short_first[0], dense(q[0], k_cache, v_cache, table_short[0], short), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_split_sequences_are_the_same_on_any_number_of_threads(kernels, cache_dtype):
    """A few long sequences are split into partitions that the threads claim from runs of their own,
    taking the others' from the back when theirs are done (three or five threads on a 2-core machine
    run oversubscribed, so runs are stolen); whoever computes a partition, and whoever merges a
    sequence, the result is bit-identical to one thread's."""
    gen = torch.Generator().manual_seed(5)
    bs, kvh, heads, d = 16, 3, 9, 64
    lens = torch.tensor([2000, 700, 65])  # 32, 11 and 2 partitions of 64 tokens
    per_seq = -(-int(lens.max()) // bs)
    nb = len(lens) * per_seq
    k, v = torch.randn(nb, bs, kvh, d, generator=gen), torch.randn(nb, bs, kvh, d, generator=gen)
    k_cache, v_cache = as_cache(k, cache_dtype, KEYS), as_cache(v, cache_dtype, VALUES)
    table = torch.randperm(nb, generator=gen).view(len(lens), per_seq)
    q = torch.randn(len(lens), heads, d, generator=gen) * 3
    before = torch.get_num_threads()
    outs = {}
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            for rows in (slice(0, 1), slice(0, 3)):  # one sequence alone, and the three together
                for _ in range(3):  # claims race differently each call
                    got = kernels.paged_decode_attention(q[rows], k_cache, v_cache, table[rows], lens[rows], d**-0.5)
                    ref = outs.setdefault(rows.stop, got)
                    assert torch.equal(got, ref), f"{threads} threads, {rows.stop} sequences"
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[1][0], outs[3][0])
    if cache_dtype == torch.float32:
        for i, n in enumerate(lens.tolist()):
            torch.testing.assert_close(outs[3][i], dense(q[i], k, v, table[i], n), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_paths_agree(kernels, cache_dtype):
    """The same decode batch through the kernel and through gather + SDPA."""
    torch.manual_seed(1)
    nb, bs, kvh, h, d = 16, 4, 2, 4, 16
    k_cache = torch.randn(nb, bs, kvh, d).to(cache_dtype)
    v_cache = torch.randn(nb, bs, kvh, d).to(cache_dtype)
    table = torch.tensor([[3, 7, 0], [1, 2, 5]])
    lens = torch.tensor([9, 12])
    slots = torch.tensor([7 * bs + 0, 5 * bs + 3])  # where the new tokens go
    q, k, v = torch.randn(2, h, d), torch.randn(2, kvh, d), torch.randn(2, kvh, d)
    outs = []
    for use_kernel in (True, False):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = build_metadata(
            slot_mapping=slots.numpy(),
            block_size=bs,
            decode_blocks=list(table.numpy()),
            decode_seq_lens=lens.numpy(),
            prefills=[],
            device=torch.device("cpu"),
            backend=TorchAttentionBackend(torch.device("cpu"), use_cpu_kernel=use_kernel),
        )
        outs.append(paged_attention(q, k, v, kc, vc, meta, d**-0.5))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m, k", [(1, 576), (16, 1536), (300, 96), (0, 64), (3, 7)])
def test_quantize_per_token_matches_reference(kernels, m, k):
    from ferry.layers.int8_linear import quantize_per_token_reference

    torch.manual_seed(0)
    x = torch.randn(m, k) * torch.logspace(-4, 3, max(m, 1))[:m, None]  # rows of very different scale
    if m > 2:
        x[2] = 0.0  # an all-zero row: zero point only, no NaN
    q, scale = kernels.quantize_per_token_u8(x)
    q_ref, scale_ref = quantize_per_token_reference(x)
    assert q.dtype == torch.uint8 and q.shape == (m, k) and scale.shape == (m, 1)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    # x * (1 / s) here vs x / s there: a value on a .5 boundary may round the other way.
    if m:
        assert (q.int() - q_ref.int()).abs().max().item() <= 1
    if m > 2:
        assert torch.all(q[2] == 128)
    # A non-contiguous input is read correctly.
    xt = torch.randn(k, 5).t()
    torch.testing.assert_close(kernels.quantize_per_token_u8(xt)[1], quantize_per_token_reference(xt)[1])


def test_stale_build_lock_is_cleared(kernels):
    """A process killed while building the kernels leaves torch's lock file behind; the next
    process must load them anyway instead of waiting on it for ever."""
    import os
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    from ferry.kernels.cpu import _isa_flags

    name, _ = _isa_flags()  # this process's build: the native one, or FERRY_CPU_ISA=avx2's
    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    open(lock, "w").close()  # what a builder killed mid-build leaves
    code = "from ferry.kernels.cpu import cpu_kernels; print(cpu_kernels() is not None)"
    # The timeout only bounds a failure (a wait for ever); a pass takes as long as one import.
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
    assert not os.path.exists(lock)


def test_the_build_name_names_the_cpu_it_was_built_for(monkeypatch):
    """The kernels are built with -march=native, so a build directory shared by machines of different
    CPUs (a network home, a cache volume that moves between nodes) must not hand one CPU's build to
    another: the name carries the CPU's feature flags, besides the sources and torch."""
    from ferry.kernels import cpu

    here, _ = cpu._isa_flags()
    assert cpu._isa_flags()[0] == here  # the same CPU finds its build again
    features = cpu._cpu_features_line()
    assert ("avx2" in features.split()) == ("avx2" in cpu.cpu_flags())  # the line read is this CPU's
    other = " ".join(sorted(set(features.split()) ^ {"avx512f"}))  # with AVX-512 if this one has none, else without
    monkeypatch.setattr(cpu, "_cpu_features_line", lambda: other)
    assert cpu._isa_flags()[0] != here  # that CPU gets its own build
    monkeypatch.setenv("FERRY_CPU_ISA", "avx2")
    assert cpu._isa_flags()[0].startswith(f"{cpu.EXTENSION_NAME}_avx2_")


def test_a_compiler_that_embeds_libstdcxx_is_recognised(tmp_path):
    """The GPU image's CXX wrapper links libstdc++ statically; an extension built with it crashed
    on its first formatted TORCH_CHECK message, so the build must notice and use `c++` instead."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    wrapper = tmp_path / "static-gxx"
    wrapper.write_text(f'#!/bin/sh\nexec {compiler} "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    assert not embeds_its_own_libstdcxx(compiler)
    assert embeds_its_own_libstdcxx(str(wrapper))


_ATTENTION_ISA_SCRIPT = r"""
import sys, torch
from ferry.kernels.cpu import cpu_kernels
from ferry.kv_quant import KEYS, VALUES, quantize_blocks, rows_at
from tests.conftest import int8_values_rounding
out = {}
for d in (64, 40):  # 40: a multiple of 8, not of 16 (AVX-512's loops skip it; int8 goes through fp32)
    g = torch.Generator().manual_seed(d)
    nb, bs, kvh, heads = 48, 16, 3, 9
    lens = torch.tensor([1, 9, 16, 70, 130])
    table = torch.randperm(nb, generator=g)[:45].view(5, 9)  # 9 blocks: 130 tokens
    q = torch.randn(5, heads, d, generator=g)
    k, v = torch.randn(nb, bs, kvh, d, generator=g), torch.randn(nb, bs, kvh, d, generator=g)
    for name, (kc, vc) in {"float32": (k, v), "bfloat16": (k.bfloat16(), v.bfloat16()),
                           "int8": (quantize_blocks(k, torch.int8, KEYS),
                                    quantize_blocks(v, torch.int8, VALUES))}.items():
        out[f"{name} d={d}"] = cpu_kernels().paged_decode_attention(q, kc, vc, table, lens, d**-0.5)
    rows = [rows_at(vc, table[b].repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs, VALUES)
            for b, n in enumerate(lens.tolist())]
    out[f"int8 d={d} rounding"] = torch.stack([int8_values_rounding(r, d, heads // kvh) for r in rows])
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="without AVX-512 the native build is the AVX2 build")
def test_decode_attention_avx512_and_avx2_builds_agree(tmp_path):
    """This CPU runs the AVX-512 loops (16 values a step); an AVX2-only CPU runs the 8-wide ones,
    which the FERRY_CPU_ISA=avx2 build takes here: the same attention to fp32 rounding, for fp32, bf16
    and int8 caches, head sizes with and without a multiple of 16, one and several partitions."""
    avx2, native = outputs_of_both_cpu_builds(_ATTENTION_ISA_SCRIPT, tmp_path)
    assert set(native) == set(avx2) and len(native) == 8
    for case, y in native.items():
        if case.endswith("rounding"):
            continue
        # Both builds sum an int8 cache's values with the softmax weights rounded to int16 where head_dim
        # is a multiple of 64 (AVX2's from 16): the same weights, exponentials lane for lane alike, so
        # they should agree to the sums' rounding; the bound allows the weights' whole rounding, as it
        # did when the AVX2 loops kept them in fp32 (this test runs on AVX-512 hosts only).
        rounding = native["int8 d=64 rounding"] if case == "int8 d=64" else 0.0
        assert ((y - avx2[case]).abs() <= 2e-5 + 2e-5 * avx2[case].abs() + rounding).all(), case


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_decode_kernel_softmax_keeps_its_spread_far_below_zero(kernels, cache_dtype):
    """Every score of a sequence near -150 but several apart, in partitions shorter than a vector step:
    the softmax subtracts each partition's own max, so the weights keep their spread. (The AVX-512
    build once took the max with a short partition's unused lanes as 0, and its exponential's floor at
    e^-87 then gave every key the same weight.)"""
    from ferry.kv_quant import dequantize_rows, quantize_rows
    from tests.conftest import dense_attention

    g = torch.Generator().manual_seed(3)
    nb, bs, kvh, heads, d = 8, 16, 1, 2, 64
    direction = torch.randn(d, generator=g)
    k = (direction + 0.5 * torch.randn(nb, bs, kvh, d, generator=g)) * 4
    v = torch.randn(nb, bs, kvh, d, generator=g)
    q = -5 * direction.expand(4, heads, d) + 0.1 * torch.randn(4, heads, d, generator=g)
    lens = torch.tensor([5, 13, 21, 70])  # 70: a full 64-key partition and one of 6
    scale = d**-0.5
    if cache_dtype == torch.int8:
        kc, vc = quantize_blocks(k, torch.int8, KEYS), quantize_blocks(v, torch.int8, VALUES)
        k, v = dequantize_rows(quantize_rows(k, torch.int8)), dequantize_rows(quantize_rows(v, torch.int8))
    else:
        kc, vc = k.to(cache_dtype), v.to(cache_dtype)
        k, v = kc.float(), vc.float()
    table = torch.arange(nb).expand(len(lens), nb).contiguous()
    got = kernels.paged_decode_attention(q, kc, vc, table, lens, scale)
    keys, values = k.reshape(nb * bs, kvh, d), v.reshape(nb * bs, kvh, d)
    for i, n in enumerate(lens.tolist()):
        scores = torch.einsum("hd,nd->hn", q[i], keys[:n, 0]) * scale
        assert scores.max() < -100 and (scores.max(-1).values - scores.min(-1).values).min() > 5  # far below 0, spread
        ref = dense_attention(q[i : i + 1], keys[:n], values[:n], torch.tensor([n - 1]), scale)
        # int8: q rounded to int16 (~5e-3 of a logit here) and the weights to int16 steps
        torch.testing.assert_close(got[i : i + 1], ref, rtol=0, atol=2e-2 if cache_dtype == torch.int8 else 1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("bs", [4, 16])
def test_decode_kernel_sliding_window(kernels, cache_dtype, bs):
    """A windowed layer's decode rows in the C++ kernel (tables from the window's first block, the keys
    before the window skipped there) equal the SDPA reference's, whatever the blocks before the
    window hold (the cache manager may have handed them to another request)."""
    torch.manual_seed(5)
    nb, kvh, heads, d, window = 64, 2, 8, 64, 21
    lens = np.array([1, 20, 21, 22, bs * 5 + 3, 150])
    if cache_dtype == torch.int8:
        k_cache = quantize_blocks(torch.randn(nb, bs, kvh, d), torch.int8, KEYS)
        v_cache = quantize_blocks(torch.randn(nb, bs, kvh, d), torch.int8, VALUES)
    else:
        k_cache, v_cache = torch.randn(nb, bs, kvh, d).to(cache_dtype), torch.randn(nb, bs, kvh, d).to(cache_dtype)
    perm, used, blocks = torch.randperm(nb - 1) + 1, 0, []
    for n in lens.tolist():
        nblk = -(-n // bs)
        row = perm[used : used + nblk].numpy().copy()
        row[: max(0, n - window) // bs] = 0  # released out of the window: the stand-in block
        blocks.append(row)
        used += nblk
    q = torch.randn(len(lens), heads, d) * 2
    outs = []
    for use_kernel in (True, False):
        backend = TorchAttentionBackend(torch.device("cpu"), use_cpu_kernel=use_kernel)
        meta = build_metadata(slot_mapping=np.zeros(len(lens), dtype=np.int64), block_size=bs,  # into the stand-in
                              decode_blocks=blocks, decode_seq_lens=lens, prefills=[], device=torch.device("cpu"),
                              backend=backend)  # fmt: skip
        empty = torch.zeros(len(lens), kvh, d)
        outs.append(paged_attention(q, empty, empty, k_cache, v_cache, meta, d**-0.5, window=window))
    # An int8 cache's K dots take q rounded to int16 and its values int16 weights: ~1e-4 from SDPA's.
    tol = dict(rtol=1e-2, atol=1e-3) if cache_dtype == torch.int8 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    with pytest.raises(RuntimeError, match="skip"):
        kernels.paged_decode_attention(q[:1], k_cache, v_cache, torch.zeros(1, 4, dtype=torch.long),
                                       torch.tensor([3]), 0.1, None, torch.tensor([3]))  # fmt: skip
