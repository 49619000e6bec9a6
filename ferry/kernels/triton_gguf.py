"""GGUF block-quantized weights on CUDA: fused dequantize-matmuls for Q4_0/Q4_1/Q8_0 and the K-quants.

`gguf_matmul(x, data, qtype, K)` computes y[M, N] = x[M, K] @ dequant(w).T for a weight in ferry's kernel
layout (ferry/layers/gguf_linear.py: to_kernel_layout; per row all the blocks' quants, then their fp16
scales d, then (Q4_1) their fp16 mins m; a Q4 byte holds element l of its block in the low nibble and
element l + 16 in the high one). x is bf16, fp16 or fp32; the dot products accumulate in fp32 and y has
x's dtype.

Decode (few rows) is bound by reading the weight: each program takes BLOCK_N weight rows and one of
SPLIT_K slices of K, reads each of their bytes once (a Q4 tile is loaded as bytes, its low and high
nibbles multiplying two gathers of x's columns), dequantizes it in registers to x's dtype and takes a
`tl.dot` with x's rows padded to 16. SPLIT_K is chosen so that the grid has about two programs per SM
whatever N; partial sums then go to an fp32 [SPLIT_K, M, N] buffer summed by torch (deterministic, no
atomics, no memset). Prefill rows take the same kernel with 64-row tiles of x (the weight is re-read
once per 64 rows, which the tensor cores hide: prefill is compute-bound).

A single row of x (batch-1 decode, the latency case) takes a GEMV-shaped kernel instead: measured on an
H100 (BENCHMARKS.md), the tile kernel above pads that row to 16 for `mma` and dequantizes every nibble
into a bf16 tile, and ran a Q4_0 GEMV at 12-25% of HBM bandwidth, no faster than cuBLAS on the bf16
weight. `_gguf_gemv_kernel` reads [BLOCK_N rows, BLOCKS quant blocks] of bytes per step (16-byte loads
along each row), turns nibbles into floats with an exponent trick instead of int->float conversions
(2^23 + q has q in its mantissa: an OR and a subtraction), multiplies with x in fp32 CUDA-core FMAs,
reduces each block's 32 products, and applies the block's scale once to that sum. No tensor cores: at
one row there is nothing for them to share. `_gguf_gemv_words_kernel` does the same arithmetic in about
half the instructions a value (opt-in until a GPU times it; see its docstring).

K-quants (Q4_K, Q5_K, Q6_K) keep ggml's 256-value super-blocks (scales inline) and have a twin of each
kernel (`_kquant_gemv_kernel`, `_kquant_matmul_kernel`) that steps one super-block at a time: the GEMV
sums each sub-block's 32 (Q6_K: 16) products before its 6-bit (8-bit) scale multiplies, and takes Q4_K's
and Q5_K's mins from sums of x's sub-blocks; the tile kernel dequantizes a super-block's low and high
nibbles as two [128, BLOCK_N] tiles and dots each with the 128 columns of x they multiply. `dequantize`
(torch ops, any type, any rows) serves embedding rows and the tests' references.

Nothing here reads a tensor's values on the host or branches on them: the launches are CUDA-graph
capturable. The kernels also run under TRITON_INTERPRET=1 on CPU tensors (the tests).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

from ferry.kernels.triton_compat import apply_interpreter_numpy_fix

apply_interpreter_numpy_fix()

Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
K_QUANTS = {Q4_K: 144, Q5_K: 176, Q6_K: 210}  # type id -> bytes per 256-value super-block
BLOCK32_TYPES = (Q4_0, Q4_1, Q8_0)  # 32-value blocks, kept in ferry's kernel layout (fields split per row)
FUSED_TYPES = (*BLOCK32_TYPES, *K_QUANTS)

# Triton 3.6's interpreter multiplies the raw bits of 16-bit floats in tl.dot (see triton_attention.py):
# there the dot takes fp32 copies of the already-rounded operands, the same arithmetic.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Rows of x at or below which a matmul takes the decode configuration.
DECODE_MAX_ROWS = 16
_DEFAULT_SMS = 132  # an H100 SXM: the split heuristic's SM count where no CUDA device is visible


@triton.jit
def _dot_halves(acc, x_lo, w_lo, x_hi, w_hi, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + x_lo @ w_lo + x_hi @ w_hi (the low and the high nibbles' tiles): fp32 operands in IEEE
    precision when DOT_F32 (the interpreter, see above), IEEE dots for fp32 x, tensor-core defaults else."""
    if DOT_F32:
        acc += tl.dot(x_lo.to(tl.float32), w_lo.to(tl.float32), input_precision="ieee")
        acc += tl.dot(x_hi.to(tl.float32), w_hi.to(tl.float32), input_precision="ieee")
    elif IEEE:
        acc += tl.dot(x_lo, w_lo, input_precision="ieee")
        acc += tl.dot(x_hi, w_hi, input_precision="ieee")
    else:
        acc += tl.dot(x_lo, w_lo)
        acc += tl.dot(x_hi, w_hi)
    return acc


def _nibbles_asm(fp16: bool, zero: int) -> str:
    """`_nibbles_16bit`'s PTX: $4 holds four bytes; $0, $1 get their low nibbles minus `zero` (bytes 0, 1
    in $0's halves, 2, 3 in $1's), $2, $3 their high ones, as bf16 (fp16) pairs. PRMT spreads bytes 0, 1
    (2, 3) over the 16-bit halves of t0 (t1); LOP3 (a & b | c) puts a nibble into the mantissa of 128.0
    (fp16: 1024.0); one packed FMA takes 128 + zero off. bf16 has 7 mantissa bits, so its high nibbles
    are shifted down first; fp16's stay in place (1024 + 16 q) and the FMA scales them by 1/16."""
    if fp16:
        magic, one, sixteenth = "0x64006400", "0x3C003C00", "0x2C002C00"
        # -1032 and -72, or -1024 and -64
        lo_c, hi_c = ("0xE408E408", "0xD480D480") if zero == 8 else ("0xE400E400", "0xD400D400")
        hi_src, hi_mask, hi_m, fma = "t", "0x00F000F0", sixteenth, "fma.rn.f16x2"
    else:
        magic, one = "0x43004300", "0x3F803F80"
        lo_c = hi_c = "0xC308C308" if zero == 8 else "0xC300C300"  # -136 / -128
        hi_src, hi_mask, hi_m, fma = "u", "0x000F000F", one, "fma.rn.bf16x2"
    return (
        "{ .reg .b32 t0, t1, u0, u1, m, c; prmt.b32 t0, $4, 0, 0x4140; prmt.b32 t1, $4, 0, 0x4342;"
        " shr.b32 u0, t0, 4; shr.b32 u1, t1, 4;"
        f" lop3.b32 $0, t0, 0x000F000F, {magic}, 0xEA; lop3.b32 $1, t1, 0x000F000F, {magic}, 0xEA;"
        f" lop3.b32 $2, {hi_src}0, {hi_mask}, {magic}, 0xEA; lop3.b32 $3, {hi_src}1, {hi_mask}, {magic}, 0xEA;"
        f" mov.b32 m, {one}; mov.b32 c, {lo_c}; {fma} $0, $0, m, c; {fma} $1, $1, m, c;"
        f" mov.b32 m, {hi_m}; mov.b32 c, {hi_c}; {fma} $2, $2, m, c; {fma} $3, $3, m, c; }}"
    )


_NIBBLES_BF16_Q4_0 = tl.constexpr(_nibbles_asm(False, 8))
_NIBBLES_BF16_Q4_1 = tl.constexpr(_nibbles_asm(False, 0))
_NIBBLES_F16_Q4_0 = tl.constexpr(_nibbles_asm(True, 8))
_NIBBLES_F16_Q4_1 = tl.constexpr(_nibbles_asm(True, 0))


@triton.jit
def _nibbles_16bit(byte, ZERO: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr):
    """The low and the high nibbles of uint8 `byte` minus ZERO (8: Q4_0, 0: Q4_1) as exact integer-valued
    bf16 (fp16 when FP16). On a GPU four bytes take ten instructions (`_nibbles_asm`) for their eight
    values, against ~10 a value for a byte's nibbles to fp32, times d, to 16 bits; where no PTX runs
    (the interpreter), the same values in plain ops."""
    dt: tl.constexpr = tl.float16 if FP16 else tl.bfloat16
    if ASM:
        if FP16:
            asm: tl.constexpr = _NIBBLES_F16_Q4_0 if ZERO == 8 else _NIBBLES_F16_Q4_1
            lo, hi = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=4)  # fmt: skip
        else:
            asm: tl.constexpr = _NIBBLES_BF16_Q4_0 if ZERO == 8 else _NIBBLES_BF16_Q4_1
            lo, hi = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [byte], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)  # fmt: skip
    else:
        b = byte.to(tl.int32)
        # through fp32: the interpreter's int -> bf16 cast is not a conversion
        lo = ((b & 15) - ZERO).to(tl.float32).to(dt)
        hi = ((b >> 4) - ZERO).to(tl.float32).to(dt)
    return lo, hi


@triton.jit
def _weight_rows(pid_n, N, K, row_bytes, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program pid_n's BLOCK_N weight rows (output columns) in ferry's kernel layout: their indices, which
    exist, each row's byte and fp16 offsets, and the fp16 index of a row's first block scale."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_row = cols.to(tl.int64) * row_bytes  # byte offset of each weight row
    s_row = cols.to(tl.int64) * (row_bytes // 2)  # fp16 offset of each weight row
    if QTYPE == 8:
        s_base = K // 2  # fp16 index of the row's first scale: after K quant bytes
    else:
        s_base = K // 4  # after K / 2 quant bytes
    return cols, cols < N, w_row, s_row, s_base


@triton.jit
def _gemv_range(x_ptr, N, K, row_bytes, blocks_per_split, stride_xm, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """A 32-value GEMV program's prologue: its split and row of x (program axes 1, 2), its BLOCK_N weight
    rows (`_weight_rows`), its quant blocks [b_begin, b_end) and the pointer to its row of x."""
    pid_k = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    cols, n_ok, w_row, s_row, s_base = _weight_rows(tl.program_id(0), N, K, row_bytes, QTYPE, BLOCK_N)
    b_begin = pid_k * blocks_per_split
    b_end = tl.minimum(b_begin + blocks_per_split, K // 32)
    return pid_k, row, cols, n_ok, w_row, s_row, s_base, b_begin, b_end, x_ptr + row * stride_xm


@triton.jit
def _gguf_matmul_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, row_bytes, k_per_split, stride_xm, stride_ys,
                        stride_ym, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
                        PACKED: tl.constexpr = False, ASM: tl.constexpr = False):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y (or of split pid_k's partial sums) over K [k_begin, k_end).
    q_ptr: the weight's bytes (int8 view for Q8_0, uint8 for Q4); s_ptr: the same bytes as fp16."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rows < M
    rows64 = rows.to(tl.int64)
    cols, n_ok, w_row, s_row, s_base = _weight_rows(pid_n, N, K, row_bytes, QTYPE, BLOCK_N)
    nb = K // 32
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if QTYPE == 8:
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < k_end
            wm = k_ok[:, None] & n_ok[None, :]
            q = tl.load(q_ptr + w_row[None, :] + kk[:, None], mask=wm, other=0).to(tl.float32)
            d = tl.load(s_ptr + s_row[None, :] + s_base + (kk // 32)[:, None], mask=wm, other=0.0).to(tl.float32)
            w = (q * d).to(x_ptr.dtype.element_ty)
            xv = tl.load(x_ptr + rows64[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0)  # fmt: skip
            if DOT_F32:
                acc += tl.dot(xv.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            elif IEEE:
                acc += tl.dot(xv, w, input_precision="ieee")
            else:
                acc += tl.dot(xv, w)
        elif PACKED:
            # Q4 with 16-bit x: per quant block, its nibbles as exact integers (q - 8, or q) in x's dtype
            # (`_nibbles_16bit`), two dots of 16, then d (and Q4_1's m times x's block sum) in fp32.
            j = tl.arange(0, 16)
            for bb in tl.static_range(BLOCK_K // 32):
                blk = k0 // 32 + bb
                b_ok = blk * 32 < k_end
                byte = tl.load(q_ptr + w_row[None, :] + (blk * 16 + j)[:, None], mask=b_ok & n_ok[None, :], other=0)
                lo, hi = _nibbles_16bit(byte, 8 if QTYPE == 2 else 0, x_ptr.dtype.element_ty == tl.float16, ASM)
                xm = m_ok[:, None] & b_ok
                x_lo = tl.load(x_ptr + rows64[:, None] * stride_xm + (blk * 32 + j)[None, :], mask=xm, other=0.0)
                x_hi = tl.load(x_ptr + rows64[:, None] * stride_xm + (blk * 32 + 16 + j)[None, :], mask=xm, other=0.0)
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                part = _dot_halves(part, x_lo, lo, x_hi, hi, IEEE, DOT_F32)
                d = tl.load(s_ptr + s_row + s_base + blk, mask=n_ok & b_ok, other=0.0).to(tl.float32)
                if QTYPE == 3:
                    mn = tl.load(s_ptr + s_row + s_base + nb + blk, mask=n_ok & b_ok, other=0.0).to(tl.float32)
                    sx = tl.sum(x_lo.to(tl.float32) + x_hi.to(tl.float32), axis=1)
                    acc += part * d[None, :] + sx[:, None] * mn[None, :]
                else:
                    acc += part * d[None, :]
        else:
            # Byte j of the tile: block (k0 + 2j) // 32, element j % 16 (low nibble) and j % 16 + 16 (high).
            j = tl.arange(0, BLOCK_K // 2)
            blk = k0 // 32 + j // 16
            k_lo = blk * 32 + j % 16
            k_ok = k_lo < k_end
            wm = k_ok[:, None] & n_ok[None, :]
            byte = tl.load(q_ptr + w_row[None, :] + (k0 // 2 + j)[:, None], mask=wm, other=0).to(tl.int32)
            d = tl.load(s_ptr + s_row[None, :] + s_base + blk[:, None], mask=wm, other=0.0).to(tl.float32)
            if QTYPE == 3:
                mn = tl.load(s_ptr + s_row[None, :] + s_base + nb + blk[:, None], mask=wm, other=0.0).to(tl.float32)
            else:
                mn = -8.0 * d
            w_lo = ((byte & 15).to(tl.float32) * d + mn).to(x_ptr.dtype.element_ty)
            w_hi = ((byte >> 4).to(tl.float32) * d + mn).to(x_ptr.dtype.element_ty)
            xm = m_ok[:, None] & k_ok[None, :]
            x_lo = tl.load(x_ptr + rows64[:, None] * stride_xm + k_lo[None, :], mask=xm, other=0.0)
            x_hi = tl.load(x_ptr + rows64[:, None] * stride_xm + (k_lo + 16)[None, :], mask=xm, other=0.0)
            acc = _dot_halves(acc, x_lo, w_lo, x_hi, w_hi, IEEE, DOT_F32)
    y = y_ptr + pid_k.to(tl.int64) * stride_ys + rows64[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# 2^23 as fp32 bits: OR-ing an integer q < 2^23 into the mantissa makes the float 2^23 + q exactly.
_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _gemv_step_loads(q_ptr, s_ptr, w_row, s_row, s_base, nb, blk, b_ok, n_ok, QTYPE: tl.constexpr):
    """One loop step's weight bytes for the GEMV: [BLOCK_N, BLOCKS, 16] (Q8_0: 32) quant bytes as int32,
    and the blocks' scales d and (Q4_1) mins as fp32 [BLOCK_N, BLOCKS] (other types: d again)."""
    wm = n_ok[:, None] & b_ok[None, :]
    d = tl.load(s_ptr + s_row[:, None] + s_base + blk[None, :], mask=wm, other=0.0).to(tl.float32)
    if QTYPE == 8:
        j = tl.arange(0, 32)
        byte = tl.load(q_ptr + w_row[:, None, None] + (blk * 32)[None, :, None] + j[None, None, :],
                       mask=wm[:, :, None], other=128).to(tl.int32)  # fmt: skip
    else:
        j = tl.arange(0, 16)
        byte = tl.load(q_ptr + w_row[:, None, None] + (blk * 16)[None, :, None] + j[None, None, :],
                       mask=wm[:, :, None], other=0).to(tl.int32)  # fmt: skip
    if QTYPE == 3:
        mn = tl.load(s_ptr + s_row[:, None] + s_base + nb + blk[None, :], mask=wm, other=0.0).to(tl.float32)
    else:
        mn = d
    return byte, d, mn


@triton.jit
def _gemv_step(acc, x_row, byte, d, mn, blk, b_ok, QTYPE: tl.constexpr):
    """acc [BLOCK_N, BLOCKS] plus one step's products: each block's 32 dot products with x, scaled once."""
    if QTYPE == 8:
        # Bytes as uint8: q + 128 = byte ^ 128 in [0, 255] goes into the mantissa as the nibbles do.
        j = tl.arange(0, 32)
        q = ((byte ^ 128) | _MAGIC_BITS).to(tl.float32, bitcast=True) - (_MAGIC + 128.0)
        xv = tl.load(x_row + (blk * 32)[:, None] + j[None, :], mask=b_ok[:, None], other=0.0).to(tl.float32)
        acc += d * tl.sum(q * xv[None, :, :], axis=2)
    else:
        # Byte j of block b: element j (low nibble) and j + 16 (high nibble) of the block.
        j = tl.arange(0, 16)
        if QTYPE == 2:  # Q4_0: w = (q - 8) d
            offset = _MAGIC + 8.0
        else:  # Q4_1: w = q d + m
            offset = _MAGIC
        lo = ((byte & 15) | _MAGIC_BITS).to(tl.float32, bitcast=True) - offset
        hi = ((byte >> 4) | _MAGIC_BITS).to(tl.float32, bitcast=True) - offset
        xb = x_row + (blk * 32)[:, None] + j[None, :]
        x_lo = tl.load(xb, mask=b_ok[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(xb + 16, mask=b_ok[:, None], other=0.0).to(tl.float32)
        dot = tl.sum(lo * x_lo[None, :, :] + hi * x_hi[None, :, :], axis=2)
        if QTYPE == 3:
            acc += d * dot + mn * tl.sum(x_lo + x_hi, axis=1)[None, :]
        else:
            acc += d * dot
    return acc


@triton.jit
def _gguf_gemv_kernel(x_ptr, q_ptr, s_ptr, y_ptr, N, K, row_bytes, blocks_per_split, stride_xm, stride_ys,
                      stride_ym, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
                      PRELOAD: tl.constexpr = False):  # fmt: skip
    """y[row, cols] (or split pid_k's partial sums) for one row of x (program axis 2) and BLOCK_N weight
    rows over quant blocks [pid_k * blocks_per_split, ...). q_ptr: the weight's bytes (uint8, Q8_0's
    too); s_ptr: the same bytes as fp16. PRELOAD: each step's weight bytes are loaded one step ahead (in
    registers; Triton does not pipeline these loads through shared memory, whatever num_stages says), so
    a program has two steps' bytes in flight instead of one; the arithmetic is the same either way."""
    pid_k, row, cols, n_ok, w_row, s_row, s_base, b_begin, b_end, x_row = _gemv_range(
        x_ptr, N, K, row_bytes, blocks_per_split, stride_xm, QTYPE, BLOCK_N)  # fmt: skip
    nb = K // 32
    acc = tl.zeros((BLOCK_N, BLOCKS), dtype=tl.float32)
    if PRELOAD:
        blk = b_begin + tl.arange(0, BLOCKS)
        byte, d, mn = _gemv_step_loads(q_ptr, s_ptr, w_row, s_row, s_base, nb, blk, blk < b_end, n_ok, QTYPE)
        for b0 in range(b_begin, b_end, BLOCKS):
            blk = b0 + tl.arange(0, BLOCKS)
            nxt = blk + BLOCKS
            byte_n, d_n, mn_n = _gemv_step_loads(q_ptr, s_ptr, w_row, s_row, s_base, nb, nxt, nxt < b_end, n_ok,
                                                 QTYPE)  # fmt: skip
            acc = _gemv_step(acc, x_row, byte, d, mn, blk, blk < b_end, QTYPE)
            byte, d, mn = byte_n, d_n, mn_n
    else:
        for b0 in range(b_begin, b_end, BLOCKS):
            blk = b0 + tl.arange(0, BLOCKS)
            b_ok = blk < b_end
            byte, d, mn = _gemv_step_loads(q_ptr, s_ptr, w_row, s_row, s_base, nb, blk, b_ok, n_ok, QTYPE)
            acc = _gemv_step(acc, x_row, byte, d, mn, blk, b_ok, QTYPE)
    y = y_ptr + pid_k.to(tl.int64) * stride_ys + row * stride_ym + cols
    tl.store(y, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _dp4a(a, b, c, SIGNED_A: tl.constexpr, ASM: tl.constexpr):
    """c + the dot product of the four bytes of a and of b (int32 words; b's bytes signed, a's signed when
    SIGNED_A, else unsigned): one PTX dp4a on a GPU; emulated with shifts where no PTX runs (the
    interpreter, whose tests check the indexing and scaling around it)."""
    if ASM:
        if SIGNED_A:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    for i in tl.static_range(4):
        ai = (a >> (8 * i)) & 255
        if SIGNED_A:
            ai = ai - ((ai & 128) << 1)
        bi = (b >> (8 * i)) & 255
        c += ai * (bi - ((bi & 128) << 1))
    return c


@triton.jit
def int8_scale(amax):
    """max |x| -> the int8 scale max |x| / 127, with IEEE division as torch's (CUDA's default fp32 `/` is
    approximate: seen 1 ulp off on an H100); an all-zero x gets a tiny scale and zeros, no NaN."""
    return tl.div_rn(tl.maximum(amax, 1e-12), 127.0)


@triton.jit
def quantize_int8(x, scale):
    """x / scale rounded to nearest, ties away from zero, within [-127, 127], as int32."""
    v = tl.div_rn(x, scale)
    r = tl.minimum(tl.floor(tl.abs(v) + 0.5), 127.0)
    return tl.where(v < 0, -r, r).to(tl.int32)


@triton.jit
def _x_halves(x_row, blk, b_ok):
    """Each block `blk` of x's row as its two halves [BLOCKS, 4 words, 4 bytes] of fp32: value 4w + i of
    the first half, and of the second (values 16 + 4w + i), as the weight's words pair them."""
    w = tl.arange(0, 4)
    offs = x_row + (blk * 32)[:, None, None] + (w * 4)[None, :, None] + w[None, None, :]
    lo = tl.load(offs, mask=b_ok[:, None, None], other=0.0).to(tl.float32)
    hi = tl.load(offs + 16, mask=b_ok[:, None, None], other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _x_words(xv, scale):
    """One half of each block (from _x_halves) as 4 int32 words of 4 int8 values (byte i of word w: value
    4w + i) quantized with the block's scale; and the sum of those int8 values per block."""
    q = quantize_int8(xv, scale[:, None, None])
    shifts = tl.arange(0, 4) * 8
    words = tl.sum((q & 255) << shifts[None, None, :], axis=2)
    return words, tl.sum(tl.sum(q, axis=2), axis=1)


@triton.jit
def _gguf_gemv_int8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, row_bytes, blocks_per_split, stride_xm, stride_ys,
                           stride_ym, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
                           ASM: tl.constexpr):  # fmt: skip
    """The GEMV kernel with integer dots, as llama.cpp's mmvq: each block of x's row is quantized to int8
    with one scale (max |x| / 127) in registers, and each weight word (8 nibbles, or 4 bytes of Q8_0) meets
    the matching word of x in one dp4a: four multiply-adds an instruction instead of the float kernel's
    unpack, convert and FMA per value. w_ptr: the weight's bytes as int32 words (row_bytes % 4 == 0);
    s_ptr: the same bytes as fp16. Q4_0: sum (q - 8) d x = d (dx sum q xq - 8 dx sum xq); Q4_1 adds the
    min times dx sum xq; Q8_0: d dx sum q xq."""
    pid_k, row, cols, n_ok, w_row, s_row, s_base, b_begin, b_end, x_row = _gemv_range(
        x_ptr, N, K, row_bytes, blocks_per_split, stride_xm, QTYPE, BLOCK_N)  # fmt: skip
    w_word = w_row // 4
    nb = K // 32
    word = tl.arange(0, 4)
    acc = tl.zeros((BLOCK_N, BLOCKS), dtype=tl.float32)
    for b0 in range(b_begin, b_end, BLOCKS):
        blk = b0 + tl.arange(0, BLOCKS)
        b_ok = blk < b_end
        wm = n_ok[:, None] & b_ok[None, :]
        xv_lo, xv_hi = _x_halves(x_row, blk, b_ok)
        amax = tl.maximum(tl.max(tl.max(tl.abs(xv_lo), axis=2), axis=1), tl.max(tl.max(tl.abs(xv_hi), axis=2), axis=1))
        scale = int8_scale(amax)  # dx per block
        x_lo, sum_lo = _x_words(xv_lo, scale)
        x_hi, sum_hi = _x_words(xv_hi, scale)
        d = tl.load(s_ptr + s_row[:, None] + s_base + blk[None, :], mask=wm, other=0.0).to(tl.float32)
        zero = tl.zeros((BLOCK_N, BLOCKS, 4), dtype=tl.int32)
        if QTYPE == 8:  # 32 signed bytes a block: words 0-3 hold values 0-15, words 4-7 values 16-31
            wp = w_ptr + w_word[:, None, None] + (blk * 8)[None, :, None] + word[None, None, :]
            lo = tl.load(wp, mask=wm[:, :, None], other=0)
            hi = tl.load(wp + 4, mask=wm[:, :, None], other=0)
            dots = _dp4a(hi, x_hi[None, :, :], _dp4a(lo, x_lo[None, :, :], zero, True, ASM), True, ASM)
            acc += d * scale[None, :] * tl.sum(dots, axis=2).to(tl.float32)
        else:  # 16 bytes a block: byte j holds value j (low nibble) and value j + 16 (high nibble)
            wq = tl.load(w_ptr + w_word[:, None, None] + (blk * 4)[None, :, None] + word[None, None, :],
                         mask=wm[:, :, None], other=0)  # fmt: skip
            dots = _dp4a(wq & 0x0F0F0F0F, x_lo[None, :, :], zero, False, ASM)
            dots = _dp4a((wq >> 4) & 0x0F0F0F0F, x_hi[None, :, :], dots, False, ASM)
            qx = scale[None, :] * tl.sum(dots, axis=2).to(tl.float32)
            sx = (scale * (sum_lo + sum_hi).to(tl.float32))[None, :]  # dx sum xq: the block's sum of x
            if QTYPE == 2:  # Q4_0: w = (q - 8) d
                acc += d * (qx - 8.0 * sx)
            else:  # Q4_1: w = q d + m
                mn = tl.load(s_ptr + s_row[:, None] + s_base + nb + blk[None, :], mask=wm, other=0.0).to(tl.float32)
                acc += d * qx + mn * sx
    y = y_ptr + pid_k.to(tl.int64) * stride_ys + row * stride_ym + cols
    tl.store(y, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _split4(w):
    """The last dimension (4, in one thread's registers) of w as four tensors."""
    even, odd = tl.split(tl.reshape(w, w.shape[:-1] + (2, 2)))  # [..., (0, 2)] and [..., (1, 3)]
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def _magic_half(w, h: tl.constexpr):
    """Half h (0: low, 1: high 16 bits) of int32 words w under 2^23's upper 16 bits: each value in it then
    becomes a float with one AND (`_value_at`; ptxas makes `(w & mask) | magic` two LOP3s, its immediates
    being one an instruction)."""
    if h == 0:
        return (w & 65535) | _MAGIC_BITS
    return ((w >> 16) & 65535) | _MAGIC_BITS


@triton.jit
def _value_at(wh, shift: tl.constexpr, bits: tl.constexpr, zero: tl.constexpr):
    """The `bits`-wide value at bit `shift` of a `_magic_half`, minus `zero`, as an exact fp32. Left where
    it lies, it is 2^23 + v 2^shift; scaling by 2^-shift and taking off 2^23 and the zero point is one
    FFMA, exact (v - zero is a float)."""
    step: tl.constexpr = float(1 << shift)
    q = (wh & ((((1 << bits) - 1) << shift) | -65536)).to(tl.float32, bitcast=True)
    return q * (1.0 / step) - (_MAGIC + zero * step) / step


@triton.jit
def _word_dot(dot, xsum, w, word: tl.constexpr, x_row, blk, b_ok, QTYPE: tl.constexpr):
    """dot [BLOCKS, BLOCK_N] plus the products of one weight word of each (block, row) with x, value by
    value: 8 nibbles (Q4) or 4 bytes (Q8_0, w already XOR 0x80808080 so byte = q + 128), each made a
    float where it lies (`_value_at`: a LOP3 and an FFMA) and multiplied with x's value in one FFMA (the
    sums contract to FFMA chains). xsum adds x's values (Q4_1's min needs them)."""
    for h in tl.static_range(2):  # the word's low and high 16 bits: shifts up to 12 stay in the mantissa
        wh = _magic_half(w, h)
        for p in tl.static_range(2 if QTYPE == 8 else 4):
            if QTYPE == 8:  # byte 2h + p of word `word`: value 4 word + 2h + p
                e = 4 * word + 2 * h + p
                q = _value_at(wh, 8 * p, 8, 128.0)
            else:  # nibble p of the half: byte 2h + p // 2 of the word, low (value j) or high (j + 16)
                e = 4 * word + 2 * h + p // 2 + 16 * (p % 2)
                q = _value_at(wh, 4 * p, 4, 8.0 if QTYPE == 2 else 0.0)
            xe = tl.load(x_row + blk * 32 + e, mask=b_ok, other=0.0).to(tl.float32)
            if QTYPE == 3:
                xsum += xe
            dot += q * xe[:, None]
    return dot, xsum


@triton.jit
def _gguf_gemv_words_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, row_bytes, blocks_per_split, stride_xm, stride_ys,
                            stride_ym, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
    """The float GEMV with fewer instructions a value (the sm_90 SASS of `_gguf_gemv_kernel`'s loop: ~8 a
    weight value, so it issues instructions, not bytes, at 40-45% of HBM bandwidth): the weight is read
    as int32 words (16 bytes a block and row, one vector load) and each word's values are taken in
    registers where they lie (`_word_dot`: a LOP3 and two FFMAs a value), with x's values loaded once per
    block for the program's BLOCK_N rows. Tiles are [BLOCKS, BLOCK_N], blocks first, so that Triton lays
    a block's rows in one thread and neighbouring threads read neighbouring blocks of a row. w_ptr: the
    weight's bytes as int32 words (row_bytes % 4 == 0); s_ptr: the same bytes as fp16."""
    pid_k, row, cols, n_ok, w_row, s_row, s_base, b_begin, b_end, x_row = _gemv_range(
        x_ptr, N, K, row_bytes, blocks_per_split, stride_xm, QTYPE, BLOCK_N)  # fmt: skip
    w_word = w_row // 4
    nb = K // 32
    word = tl.arange(0, 4)
    acc = tl.zeros((BLOCKS, BLOCK_N), dtype=tl.float32)
    for b0 in range(b_begin, b_end, BLOCKS):
        blk = b0 + tl.arange(0, BLOCKS)
        b_ok = blk < b_end
        wm = b_ok[:, None] & n_ok[None, :]
        d = tl.load(s_ptr + s_row[None, :] + s_base + blk[:, None], mask=wm, other=0.0).to(tl.float32)
        dot = tl.zeros((BLOCKS, BLOCK_N), dtype=tl.float32)
        xsum = tl.zeros((BLOCKS,), dtype=tl.float32)
        if QTYPE == 8:  # 32 bytes a block: words 0-3 hold values 0-15, words 4-7 values 16-31
            wp = w_ptr + w_word[None, :, None] + (blk * 8)[:, None, None] + word[None, None, :]
            for half in tl.static_range(2):
                w4 = tl.load(wp + 4 * half, mask=wm[:, :, None], other=0) ^ -2139062144  # ^ 0x80808080
                w0, w1, w2, w3 = _split4(w4)
                dot, xsum = _word_dot(dot, xsum, w0, 4 * half, x_row, blk, b_ok, QTYPE)
                dot, xsum = _word_dot(dot, xsum, w1, 4 * half + 1, x_row, blk, b_ok, QTYPE)
                dot, xsum = _word_dot(dot, xsum, w2, 4 * half + 2, x_row, blk, b_ok, QTYPE)
                dot, xsum = _word_dot(dot, xsum, w3, 4 * half + 3, x_row, blk, b_ok, QTYPE)
            acc += d * dot
        else:  # 16 bytes a block: byte j holds value j (low nibble) and value j + 16 (high nibble)
            w4 = tl.load(w_ptr + w_word[None, :, None] + (blk * 4)[:, None, None] + word[None, None, :],
                         mask=wm[:, :, None], other=0)  # fmt: skip
            w0, w1, w2, w3 = _split4(w4)
            dot, xsum = _word_dot(dot, xsum, w0, 0, x_row, blk, b_ok, QTYPE)
            dot, xsum = _word_dot(dot, xsum, w1, 1, x_row, blk, b_ok, QTYPE)
            dot, xsum = _word_dot(dot, xsum, w2, 2, x_row, blk, b_ok, QTYPE)
            dot, xsum = _word_dot(dot, xsum, w3, 3, x_row, blk, b_ok, QTYPE)
            if QTYPE == 3:  # Q4_1: w = q d + m
                mn = tl.load(s_ptr + s_row[None, :] + s_base + nb + blk[:, None], mask=wm, other=0.0).to(tl.float32)
                acc += d * dot + mn * xsum[:, None]
            else:  # Q4_0: w = (q - 8) d, the 8 taken off with 2^23
                acc += d * dot
    y = y_ptr + pid_k.to(tl.int64) * stride_ys + row * stride_ym + cols
    tl.store(y, tl.sum(acc, axis=0).to(y_ptr.dtype.element_ty), mask=n_ok)


# -- K-quants: 256-value super-blocks kept as ggml stores them ------------------------------------------------
#
# Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles;
# Q5_K (176 bytes): the same plus 32 bytes of fifth bits before the nibbles; value = d sc_j q - dmin mn_j
# for sub-block j of 32. Nibble byte 32p + pos holds value 64p + pos (sub-block 2p) low and 64p + 32 + pos
# (sub-block 2p + 1) high; Q5_K's fifth bits of those two are bits 2p and 2p + 1 of byte pos of qh.
# Q6_K (210 bytes): 128 bytes of low nibbles (ql), 64 of 2-bit pairs (qh), 16 int8 scales, fp16 d; value
# = d sc_s (q - 32) for sub-block s of 16. In half h (128 values), ql byte 64h + 32a + pos holds value
# 128h + 32a + pos low and 128h + 32a + 64 + pos high, whose 2 high bits are bits 2a and 2a + 4 of qh byte
# 32h + pos, and whose scales are 8h + 2a + pos // 16 and that + 4.


@triton.jit
def _k4_scale_min(scales, j, mask):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-blocks j (an int tensor, 0..7) of the super-blocks whose
    12 scale bytes start at `scales` (a pointer tensor broadcast with j); ggml's get_scale_min_k4."""
    low = j < 4
    a = tl.load(scales + j, mask=mask, other=0).to(tl.int32)  # byte j
    b = tl.load(scales + j + 4, mask=mask, other=0).to(tl.int32)  # byte j + 4
    c = tl.load(scales + tl.where(low, j, j - 4), mask=mask, other=0).to(tl.int32)  # byte j - 4 (j >= 4)
    sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _as_float(q, offset):
    """Small non-negative ints q (< 2^23) as fp32 minus `offset` (which includes 2^23): OR q into the
    mantissa of 2^23 and subtract, instead of an int -> float conversion."""
    return (q | _MAGIC_BITS).to(tl.float32, bitcast=True) - offset


@triton.jit
def _k45_values(sb, p, pos, mask, QTYPE: tl.constexpr):
    """Q4_K/Q5_K: the unsigned 4/5-bit values of nibble bytes 32p + pos of super-blocks `sb` (pointer tensor
    to each block's first byte, broadcast with p and pos): (low halves: sub-block 2p, high: sub-block 2p + 1)."""
    if QTYPE == 12:
        byte = tl.load(sb + 16 + 32 * p + pos, mask=mask, other=0).to(tl.int32)
        return byte & 15, byte >> 4
    byte = tl.load(sb + 48 + 32 * p + pos, mask=mask, other=0).to(tl.int32)
    qh = tl.load(sb + 16 + pos, mask=mask, other=0).to(tl.int32)
    return (byte & 15) | (((qh >> (2 * p)) & 1) << 4), (byte >> 4) | (((qh >> (2 * p + 1)) & 1) << 4)


@triton.jit
def _q6k_values(sb, g, i, mask):
    """Q6_K: ql byte 16g + i of super-blocks `sb` (g in 0..7 groups of 16 bytes, i in 0..15) gives two values
    in 0..63 (subtract 32): low nibble and high nibble with their 2 high bits from qh."""
    h = g // 4
    a = (g // 2) % 2
    pos = 16 * (g % 2) + i
    ql = tl.load(sb + 16 * g + i, mask=mask, other=0).to(tl.int32)
    qh = tl.load(sb + 128 + 32 * h + pos, mask=mask, other=0).to(tl.int32)
    return (ql & 15) | (((qh >> (2 * a)) & 3) << 4), (ql >> 4) | (((qh >> (2 * a + 4)) & 3) << 4)


@triton.jit
def _q6k_column(g, i):
    """Q6_K: the value index within a super-block of ql byte 16g + i's low nibble (the high one's is + 64)."""
    return 128 * (g // 4) + 32 * ((g // 2) % 2) + 16 * (g % 2) + i


@triton.jit
def _q6k_scale_index(g):
    """Q6_K: the index of the 16-value scale of ql bytes 16g.. 16g + 15's low nibbles (the high ones': + 4)."""
    return 8 * (g // 4) + 2 * ((g // 2) % 2) + g % 2


@triton.jit
def _super_block_range(pid_n, pid_k, N, K, row_bytes, sb_per_split, BLOCK_N: tl.constexpr):
    """The K-quant kernels' prologue: program pid_n's BLOCK_N weight rows (indices, which exist, byte
    offsets) and split pid_k's super-blocks [sb_begin, sb_end)."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    sb_begin = pid_k * sb_per_split
    sb_end = tl.minimum(sb_begin + sb_per_split, K // 256)
    return cols, cols < N, cols.to(tl.int64) * row_bytes, sb_begin, sb_end


@triton.jit
def _kquant_gemv_kernel(x_ptr, q_ptr, s_ptr, y_ptr, N, K, row_bytes, sb_per_split, stride_xm, stride_ys,
                        stride_ym, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The GEMV kernel's K-quant twin: y[row, cols] (or split pid_k's partial sums) for one row of x and
    BLOCK_N weight rows over super-blocks [pid_k * sb_per_split, ...), one super-block per step (4 KB of
    Q4_K nibbles for 32 rows). Each 32 (Q6_K: 16) products are summed before their scale multiplies.
    q_ptr: the weight's bytes (uint8); s_ptr: the same bytes as fp16."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    cols, n_ok, w_row, sb_begin, sb_end = _super_block_range(pid_n, pid_k, N, K, row_bytes, sb_per_split, BLOCK_N)
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    m3 = n_ok[:, None, None]
    m2 = n_ok[:, None]
    for s in range(sb_begin, sb_end):
        sb = q_ptr + w_row + s * BLOCK_BYTES  # [BLOCK_N] first byte of each row's super-block s
        sb3 = sb[:, None, None]
        xs = x_row + s * 256
        if QTYPE == 14:
            g = tl.arange(0, 8)[None, :, None]
            i = tl.arange(0, 16)[None, None, :]
            q_lo, q_hi = _q6k_values(sb3, g, i, m3)
            col = _q6k_column(tl.arange(0, 8)[:, None], tl.arange(0, 16)[None, :])
            x_lo = tl.load(xs + col).to(tl.float32)  # [8, 16]
            x_hi = tl.load(xs + col + 64).to(tl.float32)
            dot_lo = tl.sum(_as_float(q_lo, _MAGIC + 32.0) * x_lo[None, :, :], axis=2)  # [BLOCK_N, 8]
            dot_hi = tl.sum(_as_float(q_hi, _MAGIC + 32.0) * x_hi[None, :, :], axis=2)
            s_lo = _q6k_scale_index(tl.arange(0, 8))[None, :]  # [1, 8]
            sc = sb[:, None] + 192
            sc_lo = tl.load(sc + s_lo, mask=m2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            sc_hi = tl.load(sc + s_lo + 4, mask=m2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            d = tl.load(s_ptr + (w_row + s * BLOCK_BYTES + 208) // 2, mask=n_ok, other=0.0).to(tl.float32)
            acc += d * tl.sum(sc_lo * dot_lo + sc_hi * dot_hi, axis=1)
        else:
            p = tl.arange(0, 4)
            pos = tl.arange(0, 32)
            q_lo, q_hi = _k45_values(sb3, p[None, :, None], pos[None, None, :], m3, QTYPE)
            x_lo = tl.load(xs + 64 * p[:, None] + pos[None, :]).to(tl.float32)  # [4, 32]
            x_hi = tl.load(xs + 64 * p[:, None] + 32 + pos[None, :]).to(tl.float32)
            dot_lo = tl.sum(_as_float(q_lo, _MAGIC) * x_lo[None, :, :], axis=2)  # [BLOCK_N, 4]
            dot_hi = tl.sum(_as_float(q_hi, _MAGIC) * x_hi[None, :, :], axis=2)
            sc_lo, mn_lo = _k4_scale_min(sb[:, None] + 4, 2 * p[None, :], m2)
            sc_hi, mn_hi = _k4_scale_min(sb[:, None] + 4, 2 * p[None, :] + 1, m2)
            half = (w_row + s * BLOCK_BYTES) // 2
            d = tl.load(s_ptr + half, mask=n_ok, other=0.0).to(tl.float32)
            dmin = tl.load(s_ptr + half + 1, mask=n_ok, other=0.0).to(tl.float32)
            mins = mn_lo * tl.sum(x_lo, axis=1)[None, :] + mn_hi * tl.sum(x_hi, axis=1)[None, :]
            acc += d * tl.sum(sc_lo * dot_lo + sc_hi * dot_hi, axis=1) - dmin * tl.sum(mins, axis=1)
    y = y_ptr + pid_k.to(tl.int64) * stride_ys + row * stride_ym + cols
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _q4k_word_dot(dot_lo, dot_hi, sum_lo, sum_hi, w, word: tl.constexpr, x_chunk, c_ok):
    """Q4_K's `_word_dot`: word `word` (0..7) of each (chunk, row) holds bytes 4 word .. 4 word + 3 of a
    32-byte nibble chunk, whose low nibbles are values 4 word + m of the chunk's first sub-block and high
    ones of its second: two chains (dot_lo, dot_hi [CHUNKS, BLOCK_N]) and the sub-blocks' sums of x."""
    for h in tl.static_range(2):
        wh = _magic_half(w, h)
        for p in tl.static_range(4):
            q = _value_at(wh, 4 * p, 4, 0.0)
            e = 4 * word + 2 * h + p // 2
            if p % 2 == 0:  # low nibble: the first sub-block
                xe = tl.load(x_chunk + e, mask=c_ok, other=0.0).to(tl.float32)
                sum_lo += xe
                dot_lo += q * xe[:, None]
            else:
                xe = tl.load(x_chunk + 32 + e, mask=c_ok, other=0.0).to(tl.float32)
                sum_hi += xe
                dot_hi += q * xe[:, None]
    return dot_lo, dot_hi, sum_lo, sum_hi


@triton.jit
def _q4k_gemv_words_kernel(x_ptr, w_ptr, q_ptr, s_ptr, y_ptr, N, K, row_bytes, sb_per_split, stride_xm, stride_ys,
                           stride_ym, BLOCK_N: tl.constexpr, SB: tl.constexpr):  # fmt: skip
    """The word GEMV for Q4_K: tiles [CHUNKS, BLOCK_N], a chunk being a quarter of a super-block (32
    nibble bytes: sub-blocks 2c and 2c + 1, 64 values), SB super-blocks a step; a thread takes one
    chunk of BLOCK_N rows, its eight int32 words taken apart as `_gguf_gemv_words_kernel` does (LOP3 and
    two FFMAs a value), each sub-block's sum scaled once by d sc and its min by dmin mn times x's sum.
    w_ptr: the bytes as int32 words (144-byte super-blocks: rows are whole words); q_ptr: as uint8 (the
    scales); s_ptr: as fp16 (d, dmin)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    cols, n_ok, w_row, sb_begin, sb_end = _super_block_range(pid_n, pid_k, N, K, row_bytes, sb_per_split, BLOCK_N)
    x_row = x_ptr + row * stride_xm
    c = tl.arange(0, 4 * SB)  # the step's chunks: super-block c // 4, quarter c % 4
    word = tl.arange(0, 4)
    acc = tl.zeros((4 * SB, BLOCK_N), dtype=tl.float32)
    for s0 in range(sb_begin, sb_end, SB):
        sb = s0 + c // 4
        c_ok = sb < sb_end
        cm = c_ok[:, None] & n_ok[None, :]
        first = w_row[None, :] + (sb * 144)[:, None]  # [CHUNKS, BLOCK_N] byte offset of each super-block
        quarter = (c % 4)[:, None]
        half = (first + 16 + 32 * quarter) // 4  # the chunk's first word: after d, dmin and 12 scale bytes
        wa = tl.load(w_ptr + half[:, :, None] + word[None, None, :], mask=cm[:, :, None], other=0)
        wb = tl.load(w_ptr + half[:, :, None] + 4 + word[None, None, :], mask=cm[:, :, None], other=0)
        x_chunk = x_row + sb * 256 + 64 * (c % 4)
        dot_lo = tl.zeros((4 * SB, BLOCK_N), dtype=tl.float32)
        dot_hi = tl.zeros((4 * SB, BLOCK_N), dtype=tl.float32)
        sum_lo = tl.zeros((4 * SB,), dtype=tl.float32)
        sum_hi = tl.zeros((4 * SB,), dtype=tl.float32)
        w0, w1, w2, w3 = _split4(wa)
        dot_lo, dot_hi, sum_lo, sum_hi = _q4k_word_dot(dot_lo, dot_hi, sum_lo, sum_hi, w0, 0, x_chunk, c_ok)
        dot_lo, dot_hi, sum_lo, sum_hi = _q4k_word_dot(dot_lo, dot_hi, sum_lo, sum_hi, w1, 1, x_chunk, c_ok)
        dot_lo, dot_hi, sum_lo, sum_hi = _q4k_word_dot(dot_lo, dot_hi, sum_lo, sum_hi, w2, 2, x_chunk, c_ok)
        dot_lo, dot_hi, sum_lo, sum_hi = _q4k_word_dot(dot_lo, dot_hi, sum_lo, sum_hi, w3, 3, x_chunk, c_ok)
        w4, w5, w6, w7 = _split4(wb)
        dot_lo, dot_hi, sum_lo, sum_hi = _q4k_word_dot(dot_lo, dot_hi, sum_lo, sum_hi, w4, 4, x_chunk, c_ok)
        dot_lo, dot_hi, sum_lo, sum_hi = _q4k_word_dot(dot_lo, dot_hi, sum_lo, sum_hi, w5, 5, x_chunk, c_ok)
        dot_lo, dot_hi, sum_lo, sum_hi = _q4k_word_dot(dot_lo, dot_hi, sum_lo, sum_hi, w6, 6, x_chunk, c_ok)
        dot_lo, dot_hi, sum_lo, sum_hi = _q4k_word_dot(dot_lo, dot_hi, sum_lo, sum_hi, w7, 7, x_chunk, c_ok)
        sc_lo, mn_lo = _k4_scale_min(q_ptr + first + 4, 2 * quarter, cm)
        sc_hi, mn_hi = _k4_scale_min(q_ptr + first + 4, 2 * quarter + 1, cm)
        d = tl.load(s_ptr + first // 2, mask=cm, other=0.0).to(tl.float32)
        dmin = tl.load(s_ptr + first // 2 + 1, mask=cm, other=0.0).to(tl.float32)
        acc += d * (sc_lo * dot_lo + sc_hi * dot_hi) - dmin * (mn_lo * sum_lo[:, None] + mn_hi * sum_hi[:, None])
    y = y_ptr + pid_k.to(tl.int64) * stride_ys + row * stride_ym + cols
    tl.store(y, tl.sum(acc, axis=0).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _kquant_matmul_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, row_bytes, sb_per_split, stride_xm, stride_ys,
                          stride_ym, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """The tile kernel's K-quant twin: one [BLOCK_M, BLOCK_N] tile of y (or of split pid_k's partial sums)
    over super-blocks [pid_k * sb_per_split, ...). Per super-block the weight tile is dequantized in
    registers to x's dtype as two [128, BLOCK_N] halves (the low and the high nibbles), each dotted with
    the 128 columns of x it multiplies."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    cols, n_ok, w_row, sb_begin, sb_end = _super_block_range(pid_n, pid_k, N, K, row_bytes, sb_per_split, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    wt = x_ptr.dtype.element_ty
    m3 = n_ok[None, None, :]
    for s in range(sb_begin, sb_end):
        sb = q_ptr + w_row + s * BLOCK_BYTES  # [BLOCK_N]
        sb3 = sb[None, None, :]
        if QTYPE == 14:
            g = tl.arange(0, 8)[:, None, None]
            i = tl.arange(0, 16)[None, :, None]
            q_lo, q_hi = _q6k_values(sb3, g, i, m3)  # [8, 16, BLOCK_N]
            col = _q6k_column(g, i)  # [8, 16, 1]
            sub = _q6k_scale_index(g)  # [8, 1, 1]
            sc_lo = tl.load(sb3 + 192 + sub, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            sc_hi = tl.load(sb3 + 196 + sub, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            d = tl.load(s_ptr + (w_row + s * BLOCK_BYTES + 208) // 2, mask=n_ok, other=0.0).to(tl.float32)
            w_lo = (d[None, None, :] * sc_lo) * (q_lo - 32).to(tl.float32)
            w_hi = (d[None, None, :] * sc_hi) * (q_hi - 32).to(tl.float32)
            col = tl.reshape(col, (128,))
            hi_col = col + 64
        else:
            p = tl.arange(0, 4)[:, None, None]
            pos = tl.arange(0, 32)[None, :, None]
            q_lo, q_hi = _k45_values(sb3, p, pos, m3, QTYPE)  # [4, 32, BLOCK_N]
            sc_lo, mn_lo = _k4_scale_min(sb3 + 4, 2 * p, m3)  # [4, 1, BLOCK_N]
            sc_hi, mn_hi = _k4_scale_min(sb3 + 4, 2 * p + 1, m3)
            half = (w_row + s * BLOCK_BYTES) // 2
            d = tl.load(s_ptr + half, mask=n_ok, other=0.0).to(tl.float32)[None, None, :]
            dmin = tl.load(s_ptr + half + 1, mask=n_ok, other=0.0).to(tl.float32)[None, None, :]
            w_lo = (d * sc_lo) * q_lo.to(tl.float32) - dmin * mn_lo
            w_hi = (d * sc_hi) * q_hi.to(tl.float32) - dmin * mn_hi
            col = tl.reshape(64 * p + pos, (128,))
            hi_col = col + 32
        w_lo = tl.reshape(w_lo, (128, BLOCK_N)).to(wt)
        w_hi = tl.reshape(w_hi, (128, BLOCK_N)).to(wt)
        xm = m_ok[:, None]
        x_lo = tl.load(x_rows + s * 256 + col[None, :], mask=xm, other=0.0)  # [BLOCK_M, 128]
        x_hi = tl.load(x_rows + s * 256 + hi_col[None, :], mask=xm, other=0.0)
        acc = _dot_halves(acc, x_lo, w_lo, x_hi, w_hi, IEEE, DOT_F32)
    y = y_ptr + pid_k.to(tl.int64) * stride_ys + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _num_sms(device_index: int | None) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    return _DEFAULT_SMS


def decode_split_k(tiles: int, k_chunks: int, num_sms: int) -> int:
    """K splits (a power of two, at most one per K chunk) that give a decode launch of `tiles` output
    tiles about two programs per SM: few rows of x leave a weight-bound GEMV with too few tiles to
    fill the GPU, and every split still reads its own slice of each weight row once."""
    split = 1
    while split * 2 <= k_chunks and tiles * split * 2 <= 2 * num_sms:
        split *= 2
    return split


def num_sms(device: torch.device) -> int:
    """The SM count the split heuristic plans for: the device's, or an H100's off CUDA (the tests)."""
    return _num_sms(device.index) if device.type == "cuda" else _DEFAULT_SMS


def matmul_config(
    M: int, N: int, K: int, qtype: int, num_sms: int = _DEFAULT_SMS, packed: bool = False
) -> dict[str, int | bool]:
    """Tile sizes and K splits of one launch: host arithmetic on shapes only (graph-safe). K-quant tiles
    step one super-block (256 columns) at a time and split K in super-blocks (`sb_per_split`). `packed`
    asks decode tiles of Q4_0/Q4_1 to take their nibbles as exact integers in x's 16-bit dtype
    (`_nibbles_16bit`) and their scales after the dots: 7.3 SASS instructions a value against 10.6 for
    Q4_0 (sm_90), 11.9 against 12.2 for Q4_1, untimed on a GPU."""
    if qtype in K_QUANTS:
        nsb = K // 256
        block_m, block_n = (16, 32) if M <= DECODE_MAX_ROWS else (64, 64)
        split = decode_split_k(triton.cdiv(N, block_n), nsb, num_sms) if M <= DECODE_MAX_ROWS else 1
        per_split = triton.cdiv(nsb, split)
        return {"BLOCK_M": block_m, "BLOCK_N": block_n, "split": triton.cdiv(nsb, per_split),
                "sb_per_split": per_split, "num_warps": 4 if M <= DECODE_MAX_ROWS else 8, "num_stages": 2}  # fmt: skip
    if M <= DECODE_MAX_ROWS:
        block_m, block_n, block_k = 16, 64, 128 if qtype != Q8_0 else 64
        block_k = min(block_k, max(32, triton.next_power_of_2(K)))
        split = decode_split_k(triton.cdiv(N, block_n), triton.cdiv(K, block_k), num_sms)
        num_warps, num_stages = 4, 3
    else:
        block_m, block_n, block_k, split = 64, 64, 64, 1
        num_warps, num_stages = 4, 3
    k_per_split = triton.cdiv(triton.cdiv(K, block_k), split) * block_k
    split = triton.cdiv(K, k_per_split)  # no empty split
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "split": split, "k_per_split": k_per_split,
            "num_warps": num_warps, "num_stages": num_stages,
            "PACKED": packed and M <= DECODE_MAX_ROWS and qtype in (Q4_0, Q4_1)}  # fmt: skip


# Rows of x at or below which a matmul takes the GEMV kernel (one program row per x row; the weight is
# read once per row, from L2 after the first).
GEMV_MAX_ROWS = 1


# Whether a batch-1 matmul of 32-value blocks takes the integer-dot GEMV (`_gguf_gemv_int8_kernel`)
# instead of the float one. Off: on an H100 (2026-11-27, scripts/gguf_gemv_sweep.py, BENCHMARKS.md) the
# integer dots at their best tiles only equal the float kernel at its own (93 against ~91 us a Llama-3.1-8B
# layer) with 3x its error, and their first tiles ranked 16th-69th of 96.
GEMV_INT8_DOTS = False
# Whether it takes the word GEMV (`_gguf_gemv_words_kernel`): ~4 instructions a weight value against the
# float kernel's ~8 in their sm_90 SASS, correct under the interpreter; off until a GPU times it
# (scripts/gguf_gemv_sweep.py; gpu_session.sh's latency-int4-words runs a whole model with it).
GEMV_WORDS = os.environ.get("FERRY_GGUF_GEMV_WORDS") == "1"
if GEMV_WORDS:
    logging.getLogger(__name__).info("GGUF batch-1 matmuls take the word GEMV (FERRY_GGUF_GEMV_WORDS=1)")
# Whether decode tiles (2-16 rows) of Q4_0/Q4_1 take their nibbles packed (`matmul_config(packed=)`): off
# until a GPU times it (gpu_session.sh's latency-int4-packed).
GEMM_PACKED = os.environ.get("FERRY_GGUF_PACKED_DEQUANT") == "1"
if GEMM_PACKED:
    logging.getLogger(__name__).info("GGUF decode tiles take packed nibbles (FERRY_GGUF_PACKED_DEQUANT=1)")


def _word_warps(units: int, per_warp: int) -> int:
    """The word GEMVs' warps: up to 4, as many as K has `per_warp` units (blocks, super-blocks) for."""
    return 4 if units >= 4 * per_warp else 2 if units >= 2 * per_warp else 1


def gemv_config(
    N: int, K: int, qtype: int, num_sms: int = _DEFAULT_SMS, int8_dots: bool = False, words: bool = False
) -> dict[str, int | bool]:
    """The GEMV kernel's tiles and K splits: host arithmetic on shapes only (graph-safe). BLOCKS quant
    blocks of BLOCK_N rows per step. The float kernel's 32-value blocks: 8 rows x 64 blocks (8 KB of Q4
    bytes a step, 64 per thread) for 4 warps, one stage: the best of scripts/gguf_gemv_sweep.py's 95-99
    tilings for three of Llama-3.1-8B's four projection shapes and 3% off the best for qkv, timed on an
    H100 with each weight read from HBM (2026-11-27, fifth lease: 13.4 / 9.8 / 43.8 / 26.3 us for qkv /
    o / gate_up / down against 14.8 / 13.3 / 46.5 / 41.6 with the earlier 16 rows x 8 blocks and 8 warps,
    which the first leases' sweeps, timing L2-resident weights, had picked).
    `int8_dots` asks for the integer-dot kernel where rows are whole int32 words, with its best tiles
    of the 2026-11-27 sweep (32 rows x 16 blocks, 4 warps; each thread loads 16 bytes). `words` asks for
    the word GEMV where rows are whole int32 words: 8 rows of one block a thread (4.2 instructions a
    value in its sm_90 SASS; 16 rows: 3.8, but 168 registers) and 32 blocks a warp, up to 4 warps as K
    has blocks for them (no tile timed on a GPU yet); for Q4_K (`_q4k_gemv_words_kernel`, 5.1 against
    9.2) 8 rows of a quarter super-block a thread, 8 super-blocks a warp. K-quants step
    one super-block (4 KB of Q4_K nibbles for 32 rows and 4 warps) and split K in super-blocks
    (`sb_per_split`)."""
    if qtype == Q4_K and words:  # a warp takes 8 super-blocks (32 chunks) of 8 rows a step
        nsb = K // 256
        warps = _word_warps(nsb, 8)
        sb = 8 * warps
        split = decode_split_k(triton.cdiv(N, 8), triton.cdiv(nsb, sb), num_sms)
        per_split = triton.cdiv(triton.cdiv(nsb, sb), split) * sb
        return {"BLOCK_N": 8, "SB": sb, "split": triton.cdiv(nsb, per_split), "sb_per_split": per_split,
                "num_warps": warps, "num_stages": 1, "WORDS": True}  # fmt: skip
    if qtype in K_QUANTS:
        block_n = 32
        nsb = K // 256
        per_split = triton.cdiv(nsb, decode_split_k(triton.cdiv(N, block_n), nsb, num_sms))
        return {"BLOCK_N": block_n, "split": triton.cdiv(nsb, per_split), "sb_per_split": per_split,
                "num_warps": 4, "num_stages": 3}  # fmt: skip
    whole_words = block32_row_bytes(K, qtype) % 4 == 0
    int8_dots = int8_dots and whole_words
    words = words and whole_words and not int8_dots
    nb = K // 32
    if words:
        warps = _word_warps(nb, 32)
        block_n, blocks = 8, 32 * warps
    else:
        block_n, blocks, warps = (32, 16, 4) if int8_dots else (8, 64, 4)
    split = decode_split_k(triton.cdiv(N, block_n), triton.cdiv(nb, blocks), num_sms)
    blocks_per_split = triton.cdiv(triton.cdiv(nb, blocks), split) * blocks
    return {"BLOCK_N": block_n, "BLOCKS": blocks, "split": triton.cdiv(nb, blocks_per_split),
            "blocks_per_split": blocks_per_split, "num_warps": warps, "num_stages": 3 if int8_dots else 1,
            "INT8_DOTS": int8_dots, "WORDS": words}  # fmt: skip


def block32_row_bytes(K: int, qtype: int) -> int:
    """Bytes of one weight row of a 32-value type in ferry's kernel layout: quants, fp16 scales (and mins)."""
    quants = K if qtype == Q8_0 else K // 2
    return quants + (K // 32) * (4 if qtype == Q4_1 else 2)


def gguf_matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ dequant(data [N, row_bytes]).T -> [M, N] in x's dtype (fp32 sums)."""
    if qtype not in FUSED_TYPES:
        raise ValueError(f"no fused Triton kernel for GGUF type id {qtype}; dequantize() it instead")
    M, K = x.shape
    if K != in_features or K % (256 if qtype in K_QUANTS else 32):
        raise ValueError(f"activations of {K} columns for a weight of {in_features}")
    N = data.shape[0]
    x = x.contiguous()
    data = data.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    sms = num_sms(x.device)
    if M <= GEMV_MAX_ROWS:
        return launch_gemv(x, data, qtype, gemv_config(N, K, qtype, sms, GEMV_INT8_DOTS, GEMV_WORDS), y)
    return launch_tiles(x, data, qtype, matmul_config(M, N, K, qtype, sms, GEMM_PACKED), y)


def _split_sums(y: torch.Tensor, split: int) -> torch.Tensor:
    """Where a launch writes: y itself, or an fp32 [split, M, N] buffer of partial sums."""
    return y if split == 1 else torch.empty(split, *y.shape, dtype=torch.float32, device=y.device)


def launch_gemv(x: torch.Tensor, data: torch.Tensor, qtype: int, cfg: dict, y: torch.Tensor) -> torch.Tensor:
    """The GEMV kernel with the tiles of `cfg` (gemv_config's keys) into y [M, N]; x and data contiguous."""
    (M, K), (N, row_bytes), split = x.shape, data.shape, cfg["split"]
    out = _split_sums(y, split)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split, M)
    if qtype == Q4_K and cfg.get("WORDS") and data.data_ptr() % 4 == 0:  # 144-byte super-blocks: whole words
        _q4k_gemv_words_kernel[grid](x, data.view(torch.int32), data, data.view(torch.float16), out, N, K, row_bytes,
                                     cfg["sb_per_split"], x.stride(0), out.stride(0) if split > 1 else 0,
                                     out.stride(-2), BLOCK_N=cfg["BLOCK_N"], SB=cfg["SB"], num_warps=cfg["num_warps"],
                                     num_stages=cfg["num_stages"])  # fmt: skip
    elif qtype in K_QUANTS:
        _kquant_gemv_kernel[grid](x, data, data.view(torch.float16), out, N, K, row_bytes, cfg["sb_per_split"],
                                  x.stride(0), out.stride(0) if split > 1 else 0, out.stride(-2), QTYPE=qtype,
                                  BLOCK_BYTES=K_QUANTS[qtype], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
                                  num_stages=cfg["num_stages"])  # fmt: skip
    elif cfg.get("WORDS") and row_bytes % 4 == 0 and data.data_ptr() % 4 == 0:  # words of whole rows
        _gguf_gemv_words_kernel[grid](
            x, data.view(torch.int32), data.view(torch.float16), out, N, K, row_bytes, cfg["blocks_per_split"],
            x.stride(0), out.stride(0) if split > 1 else 0, out.stride(-2), QTYPE=qtype, BLOCK_N=cfg["BLOCK_N"],
            BLOCKS=cfg["BLOCKS"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    elif cfg.get("INT8_DOTS") and row_bytes % 4 == 0 and data.data_ptr() % 4 == 0:  # words of whole rows
        _gguf_gemv_int8_kernel[grid](
            x, data.view(torch.int32), data.view(torch.float16), out, N, K, row_bytes, cfg["blocks_per_split"],
            x.stride(0), out.stride(0) if split > 1 else 0, out.stride(-2), QTYPE=qtype, BLOCK_N=cfg["BLOCK_N"],
            BLOCKS=cfg["BLOCKS"], ASM=not _INTERPRETED, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])  # fmt: skip
    else:
        _gguf_gemv_kernel[grid](
            x, data, data.view(torch.float16), out, N, K, row_bytes, cfg["blocks_per_split"], x.stride(0),
            out.stride(0) if split > 1 else 0, out.stride(-2), QTYPE=qtype, BLOCK_N=cfg["BLOCK_N"],
            BLOCKS=cfg["BLOCKS"], PRELOAD=cfg.get("PRELOAD", False), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])  # fmt: skip
    if split > 1:
        y.copy_(out.sum(0))  # the splits' fp32 partial sums, rounded once to x's dtype
    return y


def launch_tiles(x: torch.Tensor, data: torch.Tensor, qtype: int, cfg: dict, y: torch.Tensor) -> torch.Tensor:
    """The tile (tensor-core) kernel with the tiles of `cfg` (matmul_config's keys) into y [M, N]."""
    (M, K), (N, row_bytes), split = x.shape, data.shape, cfg["split"]
    out = _split_sums(y, split)
    q = data.view(torch.int8) if qtype == Q8_0 else data
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), split)
    ieee, dot_f32 = x.dtype == torch.float32, _INTERPRETED and x.dtype != torch.float32
    if qtype in K_QUANTS:
        _kquant_matmul_kernel[grid](x, data, data.view(torch.float16), out, M, N, K, row_bytes, cfg["sb_per_split"],
                                    x.stride(0), out.stride(0) if split > 1 else 0, out.stride(-2), QTYPE=qtype,
                                    BLOCK_BYTES=K_QUANTS[qtype], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                    IEEE=ieee, DOT_F32=dot_f32, num_warps=cfg["num_warps"],
                                    num_stages=cfg["num_stages"])  # fmt: skip
    else:
        packed = bool(cfg.get("PACKED")) and qtype in (Q4_0, Q4_1) and x.dtype in (torch.bfloat16, torch.float16)
        _gguf_matmul_kernel[grid](x, q, data.view(torch.float16), out, M, N, K, row_bytes, cfg["k_per_split"],
                                  x.stride(0), out.stride(0) if split > 1 else 0, out.stride(-2), QTYPE=qtype,
                                  BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                  IEEE=ieee, DOT_F32=dot_f32, PACKED=packed, ASM=not _INTERPRETED,
                                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    if split > 1:
        y.copy_(out.sum(0))
    return y


# -- torch dequantizers (any device, any type): K-quant matmuls and embedding rows ----------------------------


def _halves(data: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """`count` fp16 values from byte `start` of each row (any leading dims), as fp32."""
    return data[..., start : start + 2 * count].contiguous().view(torch.float16).float()


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 8 6-bit scales and mins of each super-block from its 12 bytes s [..., 12] (int32)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def dequantize(data: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows [R, row_bytes] in ferry's kernel layout -> [R, in_features] in `dtype` (computed in fp32; the
    same values as the CPU kernels' gguf_dequantize). Columns in storage order (input_order not applied)."""
    R, K = data.shape[0], in_features
    if qtype in BLOCK32_TYPES:
        nb = K // 32
        if qtype == Q8_0:
            q = data[:, :K].view(torch.int8).float().view(R, nb, 32)
            w = q * _halves(data, K, nb)[..., None]
        else:
            b = data[:, : K // 2].view(R, nb, 16).to(torch.int32)
            q = torch.cat([b & 15, b >> 4], dim=-1).float()  # [R, nb, 32]: low nibbles, then high
            d = _halves(data, K // 2, nb)[..., None]
            m = _halves(data, K // 2 + 2 * nb, nb)[..., None] if qtype == Q4_1 else -8.0 * d
            w = q * d + m
        return w.reshape(R, K).to(dtype)
    nsb = K // 256
    blocks = data.view(R, nsb, -1).to(torch.int32)
    if qtype in (Q4_K, Q5_K):
        d = _halves(data.view(R, nsb, -1), 0, 1)  # [R, nsb, 1]
        dmin = _halves(data.view(R, nsb, -1), 2, 1)
        sc, mn = _scale_min_k4(blocks[..., 4:16])  # [R, nsb, 8]
        qs = blocks[..., 16:144] if qtype == Q4_K else blocks[..., 48:176]
        qs = qs.reshape(R, nsb, 4, 1, 32)
        v = torch.cat([qs & 15, qs >> 4], dim=3).view(R, nsb, 8, 32)  # sub-block j = 2 * pair + half
        if qtype == Q5_K:
            qh = blocks[..., 16:48].reshape(R, nsb, 1, 32)
            bit = torch.arange(8, device=data.device, dtype=torch.int32).view(1, 1, 8, 1)
            v = v + (((qh >> bit) & 1) << 4)
        w = (d * sc)[..., None] * v.float() - (dmin * mn)[..., None]
        return w.reshape(R, K).to(dtype)
    if qtype == Q6_K:
        ql = blocks[..., 0:128].reshape(R, nsb, 2, 2, 32)  # [half n, ql[n*64 : n*64+32] / ql[n*64+32 : ...], l]
        qh = blocks[..., 128:192].reshape(R, nsb, 2, 1, 32)
        shift = torch.arange(4, device=data.device, dtype=torch.int32).view(1, 1, 1, 4, 1) * 2
        hi = (qh >> shift) & 3  # [R, nsb, 2, 4, 32]: the 2 high bits of outputs l, l+32, l+64, l+96
        lo = torch.cat([ql & 15, ql >> 4], dim=3)  # same order: low nibbles of both halves, then high
        q = ((lo | (hi << 4)) - 32).float().view(R, nsb, 16, 16)
        sc = data.view(R, nsb, -1)[..., 192:208].contiguous().view(torch.int8).float()  # [R, nsb, 16]
        d = _halves(data.view(R, nsb, -1), 208, 1)
        return (q * (d * sc)[..., None]).reshape(R, K).to(dtype)
    raise ValueError(f"unsupported GGUF type id {qtype}")
