"""Dynamic W8A8 int8 on CUDA (`--quantization int8`): per-token activation quantization and an int8
tensor-core GEMM with the scales applied in its epilogue.

Weights are int8 [N, K] rows with one fp32 scale per row (symmetric, +-127, quantized once at load:
ferry/layers/int8_linear.py). Each call:

1. `quantize_rows(x)`: one program per row of x [M, K] (bf16/fp16/fp32) finds max|x| and writes
   x_q = round(x / s) in [-127, 127] as int8 with s = max|x| / 127 (fp32): per token, so one outlier
   row (a prefill token mixed with decode rows) costs no other row its resolution. Rounding is half
   away from zero (`floor(|v| + 0.5)` with the sign), as `quantize_rows_reference` computes it.
2. `int8_matmul(x_q, s_x, w_q, s_w, bias, dtype)`: y[m, n] = s_x[m] * s_w[n] * sum_k x_q[m, k] w_q[n, k]
   (+ bias[n]) in `dtype`. The integer dot runs on the tensor cores (`tl.dot` of int8 tiles into an
   int32 accumulator, exact); the scales and bias are applied once per output in fp32. Weight rows are
   K-contiguous, the layout Hopper's int8 wgmma wants for its B operand.

Decode (few rows) is bound by reading the weight, 1 byte per parameter: as in triton_gguf.py, K is split
across programs so a launch fills the SMs (`decode_split_k`), each split reading its slice of each weight
row once, and the splits' fp32 partial sums are added by torch (deterministic, no atomics; the bias comes
with split 0). Prefill rows take 64-row tiles.

Shapes only are read on the host: both launches are CUDA-graph capturable. The kernels also run under
TRITON_INTERPRET=1 on CPU tensors (tests/kernels/test_triton_int8.py). vLLM's equivalent is
`scaled_int8_quant` + `cutlass_scaled_mm`; `torch._int_mm` would need a separate scaling pass and
M > 16 on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.triton_compat import apply_interpreter_numpy_fix
from ferry.kernels.triton_gguf import DECODE_MAX_ROWS, decode_split_k, int8_scale, num_sms, quantize_int8

apply_interpreter_numpy_fix()

QMAX = 127


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    """Row program_id(0): its scale, then its int8 values. ONE_PASS (BLOCK_K covers the row): the row is
    read once into registers, all its loads in flight together; else two passes of BLOCK_K columns."""
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:
        kk = tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        scale = int8_scale(tl.max(tl.abs(v), axis=0))
        tl.store(q_ptr + row * K + kk, quantize_int8(v, scale).to(tl.int8), mask=kk < K)
        tl.store(s_ptr + row, scale)
        return
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = int8_scale(tl.max(amax, axis=0))
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * K + kk, quantize_int8(v, scale).to(tl.int8), mask=kk < K)
    tl.store(s_ptr + row, scale)


@triton.jit
def _int8_matmul_kernel(xq_ptr, sx_ptr, wq_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, k_per_split, stride_ys, stride_ym,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y (or of split pid_k's partial sums) over K [k_begin, k_end)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = output columns
    m_ok = rows < M
    n_ok = cols < N
    x_row = rows.to(tl.int64) * K
    w_row = cols.to(tl.int64) * K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_end
        a = tl.load(xq_ptr + x_row[:, None] + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(wq_ptr + w_row[None, :] + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    sx = tl.load(sx_ptr + rows, mask=m_ok, other=0.0)
    sw = tl.load(sw_ptr + cols, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)
        y += bias[None, :]
    out = y_ptr + pid_k.to(tl.int64) * stride_ys + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scales [M]): symmetric per row, see the module docstring."""
    M, K = x.shape
    x = x.contiguous()
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        # A row of up to 16k values in one pass (32 a thread at 16 warps): at batch 1 the two-pass loop's
        # dependent loads, not the bytes, set the time. Longer rows take two passes of 1024 columns.
        width = triton.next_power_of_2(K)
        one_pass = width <= _ONE_PASS_MAX
        _quantize_rows_kernel[(M,)](x, q, s, K, x.stride(0), BLOCK_K=width if one_pass else 1024, ONE_PASS=one_pass,
                                    num_warps=max(4, min(16, width // 1024)) if one_pass else 4)  # fmt: skip
    return q, s


_ONE_PASS_MAX = 16384


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version of quantize_rows (its test oracle)."""
    v = x.float()
    s = v.abs().amax(dim=-1).clamp_min(1e-12) / 127.0
    r = v / s[:, None]
    q = (torch.sign(r) * torch.floor(r.abs() + 0.5)).clamp(-QMAX, QMAX).to(torch.int8)
    return q, s


def matmul_config(M: int, N: int, K: int, sms: int) -> dict[str, int]:
    """Tile sizes and K splits of one launch: host arithmetic on shapes only (graph-safe)."""
    if M <= DECODE_MAX_ROWS:
        block_m, block_n, block_k = 16, 64, min(128, max(32, triton.next_power_of_2(K)))
        split = decode_split_k(triton.cdiv(N, block_n), triton.cdiv(K, block_k), sms)
        num_warps, num_stages = 4, 4
    else:
        block_m, block_n, block_k, split = 64, 128, 64 if K <= 64 else 128, 1
        num_warps, num_stages = 8, 3
    k_per_split = triton.cdiv(triton.cdiv(K, block_k), split) * block_k
    split = triton.cdiv(K, k_per_split)  # no empty split
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "split": split, "k_per_split": k_per_split,
            "num_warps": num_warps, "num_stages": num_stages}  # fmt: skip


def int8_matmul(
    xq: torch.Tensor,
    sx: torch.Tensor,
    wq: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """xq [M, K] int8, sx [M] fp32, wq [N, K] int8, sw [N] fp32 -> y [M, N] in `dtype`."""
    M, K = xq.shape
    N = wq.shape[0]
    if wq.shape[1] != K:
        raise ValueError(f"activations of {K} columns for an int8 weight of {wq.shape[1]}")
    y = torch.empty(M, N, dtype=dtype, device=xq.device)
    if M == 0 or N == 0:
        return y
    cfg = matmul_config(M, N, K, num_sms(xq.device))
    split = cfg["split"]
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=xq.device)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), split)
    _int8_matmul_kernel[grid](xq, sx, wq, sw, bias if bias is not None else sw, out, M, N, K, cfg["k_per_split"],
                              out.stride(0) if split > 1 else 0, out.stride(-2), HAS_BIAS=bias is not None,
                              BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    if split > 1:
        y.copy_(out.sum(0))  # the splits' fp32 partial sums, rounded once to `dtype`
    return y


def int8_linear(x2: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] in bf16/fp16/fp32 @ (wq * sw[:, None]).T + bias, activations int8 per token; x2's dtype."""
    xq, sx = quantize_rows(x2)
    return int8_matmul(xq, sx, wq, sw, bias, x2.dtype)
