"""Hugging Face checkpoints quantized by GPTQ, AWQ or compressed-tensors, read from `quantization_config`.

Each format stores a linear layer's weight as integers packed into int32 words plus per-group
scales and zero points, with w[o, i] = scale[g(i), o] * (q[o, i] - zero[g(i), o]). `unpack_module`
turns a module's tensors, whatever the format, into one `IntWeight` (unsigned levels [out, in], the
group of each input channel, scales and zeros per group); from there a weight either becomes
blocks for ferry's GGUF kernels (`IntWeight.to_gguf`, the only copy kept) or is dequantized to fp32
(CUDA, bf16, tensor parallelism, `--quantization none`).

Layouts (input channel i, output channel o, packing factor p = 32 / bits, low bits first):
- GPTQ (AutoGPTQ / GPTQModel): `qweight` [in/p, out] packed along the input; `qzeros` [groups, out/p]
  packed along the output; `scales` [groups, out] fp16; `g_idx` [in] (with desc_act the groups are
  not contiguous). checkpoint_format "gptq" (v1) stores zero - 1, "gptq_v2" the zero itself.
- AWQ (AutoAWQ, GEMM): `qweight` [in, out/8] and `qzeros` [in/g, out/8] packed along the output with
  the interleave [0, 2, 4, 6, 1, 3, 5, 7] (nibble k holds channel 8j + order[k]); `scales` [in/g, out].
- compressed-tensors: `pack-quantized` stores `weight_packed` [out, in/p] (signed values offset by
  2^(bits-1)), `weight_scale` [out, groups], for asymmetric schemes `weight_zero_point` packed the
  same way along the output ([out/p, groups]), `weight_shape`, optionally `weight_g_idx`;
  `int-quantized` (W8A8) stores `weight` int8 [out, in] and `weight_scale` [out, 1] with activations
  quantized dynamically per token.

Conversion to the kernels' blocks of 32 (exactness is tested against the fp32 dequantization):
- 4 bits, every zero 8 (symmetric): Q4_0, w = d (q - 8) with d = the fp16 scale: exact.
- 4 bits, other zeros: Q4_1, w = d q + m with m = -d * zero rounded to fp16. The product needs up to
  15 significant bits, fp16 has 11: |error| <= 2^-11 |m| <= 15 * 2^-11 d, under 1% of one
  quantization step.
- 8 bits (symmetric GPTQ / compressed-tensors, W8A8): Q8_0, q - zero as int8, exact. W8A8 runs
  on Q8_0 rather than oneDNN's int8 GEMM (`Int8Weight`): without VNNI that GEMM is exact only for
  |q| <= 63 (int8_linear.weight_qmax) and checkpoints use all of [-128, 127]; Q8_0's activations are
  quantized per 32 values, finer than the per-token quantization the checkpoint was calibrated for.
- Scales are rounded to fp16 for the blocks: exact for GPTQ/AWQ (stored fp16) and for bf16 scales in
  fp16's normal range; fp32 scales lose bits beyond fp16's 11 (the loader logs how many modules).
- Group boundaries must fall on multiples of 32 input channels. With desc_act (or any g_idx that is
  not sorted) the input channels are sorted by group at load, and the activations gathered with the
  same permutation at run time (`GGUFWeight.input_order`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ferry.layers.gguf_linear import GGUF_QUANT_TYPES, GGUFWeight

# AWQ packs output channel 8j + _AWQ_ORDER[k] into nibble k of word j.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# The tensors of one quantized module, per format (the first names the module as quantized).
_GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_TENSORS = ("qweight", "qzeros", "scales")
_PACKED_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
_INT8_TENSORS = ("weight", "weight_scale", "weight_zero_point")

BLOCK = 32  # input channels per kernel block


@dataclass(frozen=True)
class WeightScheme:
    """How one module's weight is quantized."""

    bits: int
    group_size: int  # input channels per group; -1: one group per output row
    symmetric: bool
    format: str  # "gptq" | "awq" | "pack-quantized" | "int-quantized"


@dataclass
class HFQuantization:
    """A checkpoint's `quantization_config`, checked: what ferry needs to read and run it."""

    method: str  # "gptq" | "awq" | "compressed-tensors"
    schemes: list[tuple[list[str], WeightScheme]]  # (targets, scheme); GPTQ/AWQ: one, for every module
    ignore: list[str] = field(default_factory=list)
    gptq_v1: bool = False  # GPTQ checkpoint_format "gptq": stored zeros are zero - 1

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """Suffixes of the tensors that make up a quantized module."""
        if self.method == "gptq":
            return _GPTQ_TENSORS
        if self.method == "awq":
            return _AWQ_TENSORS
        return _PACKED_TENSORS + _INT8_TENSORS

    def scheme_for(self, module: str) -> WeightScheme:
        """The scheme of checkpoint module `module` (e.g. "model.layers.0.mlp.up_proj")."""
        if self.method != "compressed-tensors":
            return self.schemes[0][1]
        for targets, scheme in self.schemes:
            if any(_target_matches(t, module) for t in targets):
                return scheme
        raise ValueError(f"compressed-tensors: quantized module {module!r} matches no config_groups targets")

    def kernel_unsupported(self, in_features: list[int]) -> str | None:
        """Why ferry's block kernels cannot run these weights (None: they can)."""
        for _, s in self.schemes:
            if s.group_size != -1 and s.group_size % BLOCK:
                return f"group_size {s.group_size} is not a multiple of {BLOCK}"
        odd = sorted({k for k in in_features if k % BLOCK})
        if odd:
            return f"input dimensions {odd} are not multiples of {BLOCK}"
        return None


def _target_matches(target: str, module: str) -> bool:
    """compressed-tensors targets: "re:<regex>" on the module name, a layer class (every quantized
    module here is a Linear), or a module name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    if target == "Linear":
        return True
    return module == target or module.endswith("." + target)


def _need(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise ValueError(f"quantization_config{where} lacks {key!r}")
    return cfg[key]


def parse_quantization_config(qc: dict[str, Any] | None) -> HFQuantization | None:
    """Parse config.json's `quantization_config`; None when there is none. An unsupported setting is
    a ValueError naming the field."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        return _parse_gptq(qc)
    if method == "awq":
        return _parse_awq(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise ValueError(
        f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported; "
        "ferry reads gptq, awq and compressed-tensors checkpoints (and GGUF files)"
    )


def _group_size(value: Any, field_name: str) -> int:
    g = int(value)
    if g != -1 and (g <= 0 or g % 8):
        raise ValueError(f"quantization_config.{field_name} = {g}: expected -1 or a positive multiple of 8")
    return g


def _parse_gptq(qc: dict[str, Any]) -> HFQuantization:
    bits = int(_need(qc, "bits", ""))
    if bits not in (4, 8):
        raise ValueError(f"quantization_config.bits = {bits}: ferry runs 4- and 8-bit GPTQ only")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r}: ferry reads gptq and gptq_v2")
    sym = bool(qc.get("sym", True))
    if bits == 8 and not sym:
        raise ValueError("quantization_config.sym = false with bits = 8: ferry runs symmetric 8-bit GPTQ only")
    if qc.get("dynamic"):
        raise ValueError("quantization_config.dynamic (per-module GPTQ overrides) is not supported")
    # desc_act needs nothing from the config: each module's g_idx says where its groups are.
    scheme = WeightScheme(bits, _group_size(qc.get("group_size", -1), "group_size"), sym, "gptq")
    return HFQuantization("gptq", [(["Linear"], scheme)], gptq_v1=fmt == "gptq")


def _parse_awq(qc: dict[str, Any]) -> HFQuantization:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version {version!r}: ferry reads AWQ's GEMM layout only")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"quantization_config.bits = {bits}: AWQ GEMM checkpoints are 4-bit")
    if not qc.get("zero_point", True):
        raise ValueError("quantization_config.zero_point = false: ferry reads AWQ with zero points only")
    group = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), "group_size")
    if group == -1:
        raise ValueError("quantization_config.group_size = -1: AWQ GEMM checkpoints are grouped")
    return HFQuantization("awq", [(["Linear"], WeightScheme(4, group, False, "awq"))])


def _parse_compressed_tensors(qc: dict[str, Any]) -> HFQuantization:
    if qc.get("sparsity_config"):
        raise ValueError("quantization_config.sparsity_config: sparse compressed-tensors checkpoints are not supported")
    if qc.get("kv_cache_scheme"):
        raise ValueError("quantization_config.kv_cache_scheme: quantized KV caches are not supported")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"quantization_config.quantization_status {status!r}: expected 'compressed'")
    top_format = qc.get("format")
    groups = _need(qc, "config_groups", "")
    schemes = []
    for name, group in groups.items():
        where = f".config_groups.{name}"
        fmt = group.get("format") or top_format
        if fmt not in ("pack-quantized", "int-quantized"):
            raise ValueError(f"quantization_config{where}.format {fmt!r}: ferry reads pack-quantized and int-quantized")
        w = _need(group, "weights", where)
        if w.get("type", "int") != "int":
            raise ValueError(f"quantization_config{where}.weights.type {w.get('type')!r}: only int weights")
        bits = int(_need(w, "num_bits", where + ".weights"))
        strategy = w.get("strategy", "tensor")
        sym = bool(w.get("symmetric", True))
        if w.get("dynamic"):
            raise ValueError(f"quantization_config{where}.weights.dynamic = true is not supported")
        if w.get("actorder") not in (None, "group", "weight", "static", False):
            raise ValueError(f"quantization_config{where}.weights.actorder {w.get('actorder')!r} is not supported")
        if strategy == "group":
            group_size = _group_size(_need(w, "group_size", where + ".weights"), "group_size")
        elif strategy in ("channel", "tensor"):
            group_size = -1
        else:
            raise ValueError(f"quantization_config{where}.weights.strategy {strategy!r}: expected group or channel")
        act = group.get("input_activations")
        if fmt == "int-quantized":
            if bits != 8 or not sym:
                raise ValueError(f"quantization_config{where}.weights: int-quantized must be symmetric 8-bit")
            if act is not None and (not act.get("dynamic") or act.get("strategy", "token") != "token"):
                raise ValueError(
                    f"quantization_config{where}.input_activations: only dynamic per-token activations are supported"
                )
        else:
            if act is not None:
                raise ValueError(
                    f"quantization_config{where}.input_activations: pack-quantized runs weight-only (W4A16/W8A16)"
                )
            if bits not in (4, 8):
                raise ValueError(f"quantization_config{where}.weights.num_bits = {bits}: ferry runs 4 and 8 bits")
            if bits == 8 and not sym:
                raise ValueError(f"quantization_config{where}.weights.symmetric = false with 8 bits is not supported")
        if group.get("output_activations") is not None:
            raise ValueError(f"quantization_config{where}.output_activations is not supported")
        targets = group.get("targets") or ["Linear"]
        schemes.append((list(targets), WeightScheme(bits, group_size, sym, fmt)))
    if not schemes:
        raise ValueError("quantization_config.config_groups is empty")
    return HFQuantization("compressed-tensors", schemes, ignore=list(qc.get("ignore") or []))


# -- quantized modules in a checkpoint -----------------------------------------------------------


def quantized_modules(spec: HFQuantization, names: set[str], dtypes: dict[str, str]) -> dict[str, list[str]]:
    """Checkpoint module name -> the names of its quantized tensors, from the header alone
    (`dtypes`: safetensors dtype string per tensor name)."""
    modules: dict[str, list[str]] = {}
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix in ("qweight", "weight_packed"):
            modules[module] = []
        elif suffix == "weight" and spec.method == "compressed-tensors" and dtypes.get(name) == "I8":
            modules[module] = []
    for module in modules:
        modules[module] = [f"{module}.{t}" for t in spec.tensor_names if f"{module}.{t}" in names]
    return modules


@dataclass
class IntWeight:
    """A quantized [out, in] weight as levels: w[o, i] = scale[o, g[i]] * (q[o, i] - zero[o, g[i]])."""

    q: torch.Tensor  # uint8 [out, in], 0 .. 2^bits - 1
    scale: torch.Tensor  # [out, groups], as stored (fp16 / bf16 / fp32)
    zero: torch.Tensor  # int16 [out, groups], levels
    g_idx: torch.Tensor  # int64 [in]: each input channel's group
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in]: the weight the checkpoint describes."""
        scale = self.scale.float()[:, self.g_idx]
        zero = self.zero[:, self.g_idx].float()
        return scale * (self.q.float() - zero)

    def scales_fit_fp16(self) -> bool:
        """Whether the blocks' fp16 scales hold these scales exactly (fp16 / most bf16 ones do)."""
        return self.scale.dtype == torch.float16 or torch.equal(self.scale.half().to(self.scale.dtype), self.scale)

    def to_gguf(self) -> GGUFWeight:
        """Blocks of 32 for the GGUF kernels (Q4_0, Q4_1 or Q8_0; see the module docstring)."""
        out, k = self.shape
        if k % BLOCK:
            raise ValueError(f"{k} input channels are not whole blocks of {BLOCK}")
        g_idx, q, order = self.g_idx, self.q, None
        if bool((g_idx[1:] < g_idx[:-1]).any()):  # desc_act: sort the input channels by group
            order = torch.argsort(g_idx, stable=True)
            g_idx, q = g_idx[order], q[:, order]
        nb = k // BLOCK
        block_groups = g_idx.view(nb, BLOCK)
        if not bool((block_groups == block_groups[:, :1]).all()):
            raise ValueError(f"quantization groups do not fall on multiples of {BLOCK} input channels")
        group = block_groups[:, 0]
        d = self.scale[:, group].to(torch.float16)
        zero = self.zero[:, group]  # [out, nb]
        blocks = q.view(out, nb, BLOCK)
        if self.bits == 8:
            diff = blocks.to(torch.int16) - zero[:, :, None]
            if int(diff.min()) < -128 or int(diff.max()) > 127:
                raise ValueError("8-bit levels minus their zero points leave int8's range (zero points other than 128)")
            qs = diff.to(torch.int8).view(torch.uint8).reshape(out, k)
            parts, type_name = [qs, d], "Q8_0"
        else:
            halves = blocks.view(out, nb, 2, BLOCK // 2)
            qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out, k // 2)
            if bool((zero == 8).all()):
                parts, type_name = [qs, d], "Q4_0"
            else:
                m = (-d.float() * zero.float()).to(torch.float16)
                parts, type_name = [qs, d, m], "Q4_1"
        data = torch.cat([p.contiguous().view(torch.uint8).reshape(out, -1) for p in parts], dim=1)
        tid, _, block_bytes = GGUF_QUANT_TYPES[type_name]
        assert data.shape[1] == nb * block_bytes
        return GGUFWeight(data.contiguous(), tid, k, input_order=order)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with p = 32/bits values per word along C (low bits first) -> int32 [R, C * p]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


def _groups_of(k: int, group_size: int) -> torch.Tensor:
    return torch.zeros(k, dtype=torch.int64) if group_size == -1 else torch.arange(k) // group_size


def unpack_module(spec: HFQuantization, module: str, t: dict[str, torch.Tensor]) -> IntWeight:
    """The tensors of one quantized module (keyed by suffix: "qweight", "scales", ...) -> IntWeight."""
    scheme = spec.scheme_for(module)
    bits = scheme.bits
    mask = (1 << bits) - 1
    try:
        if scheme.format == "gptq":
            q = _unpack_rows(t["qweight"].t(), bits)  # [out, in]
            out, k = q.shape
            zero = _unpack_rows(t["qzeros"], bits)[:, :out]  # [groups, out]
            if spec.gptq_v1:
                zero = (zero + 1) & mask
            scale = t["scales"].t()
            g_idx = t["g_idx"].long() if "g_idx" in t else _groups_of(k, scheme.group_size)
            zero = zero.t()
        elif scheme.format == "awq":
            inverse = torch.tensor([_AWQ_ORDER.index(c) for c in range(8)])

            def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
                v = _unpack_rows(packed, 4).view(packed.shape[0], -1, 8)
                return v[:, :, inverse].reshape(packed.shape[0], -1)

            q = awq_unpack(t["qweight"]).t().contiguous()  # [out, in]
            zero = awq_unpack(t["qzeros"]).t()
            scale = t["scales"].t()
            g_idx = _groups_of(q.shape[1], scheme.group_size)
        elif scheme.format == "pack-quantized":
            out, k = (int(v) for v in t["weight_shape"].tolist())
            q = _unpack_rows(t["weight_packed"], bits)[:, :k]
            scale = t["weight_scale"]
            zp = t.get("weight_zero_point")
            if zp is None or scheme.symmetric:
                zero = torch.full(scale.shape, 1 << (bits - 1), dtype=torch.int32)
            elif zp.dtype == torch.int32:  # packed along the output, offset like the weights
                zero = _unpack_rows(zp.t().contiguous(), bits)[:, :out].t()
            else:  # older writers: signed int8, unpacked
                zero = zp.to(torch.int32) + (1 << (bits - 1))
            g_idx = t["weight_g_idx"].long() if "weight_g_idx" in t else _groups_of(k, scheme.group_size)
        else:  # int-quantized: signed int8 weight, symmetric
            q = t["weight"].to(torch.int32) + 128
            scale = t["weight_scale"]
            if scale.dim() == 0 or scale.numel() == 1:
                scale = scale.reshape(1, 1).expand(q.shape[0], 1)
            zero = torch.full(scale.shape, 128, dtype=torch.int32)
            g_idx = _groups_of(q.shape[1], -1)
    except KeyError as e:
        raise ValueError(f"{module}: the checkpoint lacks its {scheme.format} tensor {e.args[0]!r}") from None
    scale = scale.reshape(q.shape[0], -1).contiguous()
    zero = zero.reshape(q.shape[0], -1).to(torch.int16).contiguous()
    groups = scale.shape[1]
    if zero.shape[1] != groups or g_idx.shape[0] != q.shape[1] or int(g_idx.max()) >= groups:
        raise ValueError(
            f"{module}: {scheme.format} tensors disagree: weight {tuple(q.shape)}, "
            f"{groups} groups of scales, {zero.shape[1]} of zeros, g_idx over {g_idx.shape[0]} channels"
        )
    return IntWeight(q.to(torch.uint8).contiguous(), scale, zero, g_idx.contiguous(), bits)
