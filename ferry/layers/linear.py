"""Linear layers, with oneDNN-packed weights for fp32 on the CPU.

torch's CPU matmul goes through MKL, which on the AMD EPYC machines we
measure on reaches ~200 GFLOP/s in fp32; oneDNN's linear with a weight
reordered once into its blocked layout reaches ~450 GFLOP/s on the same
2048³ problem, with fp32 accuracy (relative error ~7e-7 vs a float64
reference, MKL ~3e-7). Decode and prefill are dominated by these matmuls,
so the model packs every projection once after loading. Off the CPU, in
other dtypes, or where torch lacks the oneDNN ops, `F.linear` is used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferry.layers.gguf_linear import GGUFWeight, concat_rows, gguf_linear
from ferry.layers.int8_linear import Int8Rows, Int8Weight, int8_linear, pack_int8_weight
from ferry.layers.lora import LayerLoRA


def onednn_packing_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN copy of a [out, in] fp32 weight (valid for any batch size)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that can switch to a oneDNN-packed fp32 copy of its weight, to an int8 one
    (`--quantization int8`, see int8_linear.py), or run GGUF block-quantized weights as stored
    (`--quantization gguf`, see gguf_linear.py; then it has no fp32 weight at all). LoRA adapters'
    updates (lora.py), per adapter slot, are added to its output for the rows that run under them."""

    packed: torch.Tensor | None = None
    int8: Int8Weight | Int8Rows | None = None
    gguf: list[GGUFWeight] | None = None
    lora: LayerLoRA | None = None

    def drop_weight(self) -> None:
        """Free the fp32 weight (before it is ever allocated, on a meta model): the GGUF parts
        given to `set_gguf` will be the only copy."""
        self.weight = None

    def set_gguf(self, parts: list[GGUFWeight]) -> None:
        """The weight as GGUF parts stacked by output rows (e.g. q, k, v), each in its own type."""
        rows = sum(p.out_features for p in parts)
        if rows != self.out_features or any(p.in_features != self.in_features for p in parts):
            expected = (self.out_features, self.in_features)
            raise ValueError(f"GGUF parts make [{rows}, {parts[0].in_features}], expected {expected}")
        self.gguf, self.packed, self.int8 = concat_rows(parts), None, None

    def pack(self) -> None:
        """Replace the weight by its oneDNN-packed copy, which is the only copy from then on (the
        original is freed: one copy of each weight in memory). GGUF parts are interleaved for the CPU
        kernel instead (Q4_0/Q4_1; the others already run as they are). A no-op once packed."""
        if self.gguf is not None:
            self.gguf = [p.interleave() for p in self.gguf]
            return
        if self.weight is None:
            return
        self.packed, self.int8 = pack_weight(self.weight), None
        self.weight = None

    def float_weight(self) -> torch.Tensor:
        """The float weight [out, in], recovered from the oneDNN-packed copy once packed (a new tensor)."""
        if self.weight is not None:
            return self.weight
        if self.packed is not None:
            return self.packed.to_dense()
        raise ValueError("this layer holds int8 or GGUF blocks, not a float weight; dequantize those instead")

    def quantize_int8(self, triton: bool | None = None) -> None:
        """Replace the weight by int8 (per output channel, see int8_linear.py; the Triton form where
        `triton`, by default on CUDA); the original is freed."""
        if self.weight is None:
            raise ValueError("quantize_int8 needs the layer's float weight; it was already packed or quantized")
        self.packed, self.int8 = None, pack_int8_weight(self.weight, triton)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        return self.lora.apply(x, y) if self.lora else y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.gguf is not None:
            return gguf_linear(x, self.gguf, self.bias)
        if self.int8 is not None:
            return int8_linear(x, self.int8, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def should_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and onednn_packing_available()
