"""Dynamic W8A8 int8 linear (`--quantization int8`): through oneDNN on the CPU, Triton on CUDA.

On CUDA the weight is `Int8Rows` (+-127 per output channel) and the activations are quantized per
token by the Triton kernels of ferry/kernels/triton_int8.py, which apply both scales in the GEMM's
epilogue; the rest of this docstring is the CPU path.

Weights are quantized once at load time, symmetric per output channel
(scale = max|w| / 127; / 63 on CPUs without VNNI, whose int8 GEMM sums pairs
of u8 x s8 products in saturating int16, see `weight_qmax`). Activations are quantized every call, symmetric per
token (row): x_q = round(x / s_row) + 128 as uint8. oneDNN's int8 GEMM with
AVX-512 VNNI wants unsigned activations; with signed ones torch falls back to
a path ~1,000x slower. Every row shares the zero point 128, so the GEMM runs
with activation scale 1 and the per-row scale is applied to its fp32 output:
    y[m, n] = s_row[m] * s_w[n] * sum_k (x_q[m, k] - 128) * w_q[n, k].
Per-token scales keep one outlier token (a long prefill chunk mixed with
decode rows) from costing every other row its resolution; llama.cpp quantizes
activations per 32-element block for the same reason.

Decode on the CPU is bound by streaming weights from memory, so a quarter of
the bytes of fp32 makes the projections ~1.7x faster at batch 16 and ~2.2x at
512 tokens (BENCHMARKS.md); the error is ~1% per layer (tests/layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.kernels.cpu import cpu_kernels, has_int8_dot_product

# The M the weight layout is tuned for; any M works.
_PACK_HINT_ROWS = 16


def int8_linear_available() -> bool:
    """Whether the CPU path runs here: torch's oneDNN int8 ops."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops, "onednn")
        and hasattr(torch.ops.onednn, "qlinear_prepack")
        and hasattr(torch.ops.onednn, "qlinear_pointwise")
    )


def int8_triton_available() -> bool:
    """Whether the CUDA path runs here: the Triton kernels (ferry/kernels/triton_int8.py) import."""
    try:
        import ferry.kernels.triton_int8  # noqa: F401
    except Exception:  # no triton, or one too old for the kernels
        return False
    return True


@dataclass
class Int8Weight:
    packed: torch.Tensor  # opaque oneDNN int8 weight
    scale: torch.Tensor  # [out] fp32, per output channel
    zero_point: torch.Tensor  # [out] int64 zeros (symmetric)
    out_features: int


@dataclass
class Int8Rows:
    """The CUDA form: int8 rows [out, in] (+-127) and an fp32 scale per row, for the Triton kernels."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.q.shape[0]


def weight_qmax() -> int:
    """The largest int8 weight magnitude this CPU's int8 GEMM computes exactly: 127 with VNNI or
    AMX, 63 on AVX2 alone (kernels/cpu.py: has_int8_dot_product)."""
    return 127 if has_int8_dot_product() else 63


def quantize_weight(weight: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 in [-qmax, qmax]: returns (q [out, in] int8, scale [out] fp32)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / float(qmax)
    q = torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


def pack_int8_weight(weight: torch.Tensor, triton: bool | None = None) -> Int8Weight | Int8Rows:
    """The int8 form of a [out, in] weight: Int8Rows for the Triton kernels (`triton`, by default where
    the weight is on CUDA), else oneDNN's packed Int8Weight (CPU)."""
    if weight.is_cuda if triton is None else triton:
        return Int8Rows(*quantize_weight(weight, 127))
    q, scale = quantize_weight(weight, weight_qmax())
    packed = torch.ops.onednn.qlinear_prepack(q, [_PACK_HINT_ROWS, q.shape[1]])
    zero_point = torch.zeros(q.shape[0], dtype=torch.int64)
    return Int8Weight(packed, scale, zero_point, q.shape[0])


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (uint8 [M, K] with zero point 128, scale [M, 1] fp32)."""
    kernels = cpu_kernels()
    if kernels is not None:
        return kernels.quantize_per_token_u8(x)
    return quantize_per_token_reference(x)


def quantize_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version of quantize_per_token (the C++ kernel's test oracle)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-12).div_(127.0)
    q = torch.round(x / scale).add_(128.0).to(torch.uint8)
    return q, scale


def int8_linear(x: torch.Tensor, w: Int8Weight | Int8Rows, bias: torch.Tensor | None) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_zeros(*lead, w.out_features)
    if isinstance(w, Int8Rows):
        from ferry.kernels import triton_int8

        return triton_int8.int8_linear(x2, w.q, w.scale, bias).view(*lead, w.out_features)
    q, scale = quantize_per_token(x2)
    y = torch.ops.onednn.qlinear_pointwise(
        q, 1.0, 128, w.packed, w.scale, w.zero_point, None, 1.0, 0, torch.float32, "none", [], ""
    )
    y.mul_(scale)
    if bias is not None:
        y.add_(bias)
    return y.view(*lead, w.out_features)
