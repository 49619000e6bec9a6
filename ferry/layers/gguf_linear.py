"""GGUF block-quantized weights run as stored (`--quantization gguf`, the default for a quantized GGUF).

A weight keeps ggml's bytes: [out_features, row_bytes] uint8, each row K / 32 (or K / 256 for the
K-quants) blocks with their fp16 scales inline, so the model holds the file's 4.5-6.6 bits per weight
and nothing else. Decode is bound by reading weights; llama.cpp's answer, which the C++ kernel
follows (ferry/kernels/csrc/gguf_quant_cpu.cpp), is to quantize each activation row per 32 values
to int8 and take integer dot products against the nibbles. Prompt rows are compute-bound instead;
for Q4_0/Q4_1/Q8_0 the same kernel outruns an fp32 GEMM there too (INT8_PROMPT_TYPES), and every
row takes it. The K-quants' prompt rows take the exact path: the weight is dequantized, a slice at
a time, into an fp32 GEMM operand. Their rows are routed by kind, not by count (step_decode_rows),
and the kernel computes a row the same whatever rows are beside it, so a prompt computes the same
however it is chunked, cached or split between a prefill and a decode worker.

A linear whose parts have different types (llama.cpp's Q4_K_M mixes Q4_K and Q6_K, and the fused
q/k/v weight is three tensors) keeps one `GGUFWeight` per part and concatenates their outputs.

GPTQ/AWQ/compressed-tensors checkpoints run on the same blocks (models/quantized_checkpoints.py). A
GPTQ weight quantized in activation order (desc_act) has its input channels sorted by group at load;
its `input_order` says which activation column each weight column takes, and the activations are
gathered once per distinct order per call.

On CUDA the same bytes run through Triton (ferry/kernels/triton_gguf.py), in bf16/fp16/fp32
activations: fused dequantize-matmuls for Q4_0/Q4_1/Q8_0 and Q4_K/Q5_K/Q6_K that read each weight byte
once at decode batch sizes (a GEMV kernel for one row). There every row takes those kernels: the CPU's
int8-dot/exact routing (step_decode_rows) does not apply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ferry.kernels.cpu import cpu_kernels

# ggml type name -> (type id, elements per block, bytes per block): the types the kernel executes.
GGUF_QUANT_TYPES = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
_TYPE_NAMES = {tid: name for name, (tid, _, _) in GGUF_QUANT_TYPES.items()}
# On the CPU, Q4_0/Q4_1/Q8_0 weights run interleaved by 8 rows (gguf_quant_cpu.cpp says why): ferry's
# own type ids, 256 + ggml's, same bytes (Q8_0's quants offset by 128).
INTERLEAVED_TYPES = {2: 258, 3: 259, 8: 264}
_TYPE_NAMES.update({258: "Q4_0x8", 259: "Q4_1x8", 264: "Q8_0x8"})

# K-quants: from about this many rows on, dequantize + fp32 GEMM catches up with their int8 dots (at
# 64 rows the dots are 1.2-2.1x faster; at 512 rows 0.57-0.79x in the AVX2 build, 0.94-1.34x with
# VNNI, on Zen 5: `scripts/gguf_cpu_sweep.py`, BENCHMARKS.md).
GEMM_MIN_ROWS = 64

# Types whose int8-dot kernel is at least as fast as dequantize + fp32 GEMM at every row count, prompt
# rows included (at 512 rows on Zen 5: Q4_0/Q4_1 interleaved by 8 rows 2.7-3.6x with VNNI and
# 1.4-1.5x in the AVX2 build; Q8_0 rows 1.0-1.3x). Every row of theirs takes the int8 dots, as
# llama.cpp computes prompts. The K-quants' prompt rows take the exact path.
INT8_PROMPT_TYPES = frozenset({2, 3, 8, 258, 259, 264})


# Set by int8_dots_at_any_batch: every row of every matmul takes the int8 dots.
_int8_everywhere = False
# Set by exact_prompt_rows: prompt rows of every type take dequantize + fp32 GEMM.
_exact_prompts = False


@contextlib.contextmanager
def int8_dots_at_any_batch() -> Iterator[None]:
    """Run every GGUF matmul through the decode path (int8 activations), whatever its rows: how
    `ferry bench quality` and the tests measure, in one teacher-forced pass, what decode computes
    (a long prefill would otherwise take the exact dequantize-then-GEMM path)."""
    global _int8_everywhere
    saved, _int8_everywhere = _int8_everywhere, True
    try:
        yield
    finally:
        _int8_everywhere = saved


@contextlib.contextmanager
def exact_prompt_rows() -> Iterator[None]:
    """Prompt rows (and, outside a step, matmuls of GEMM_MIN_ROWS rows or more) of every type take the
    exact path: the weight dequantized into an fp32 GEMM operand. The reference the tests hold a block
    conversion to (GPTQ/AWQ repacking, TP shards), where int8 activations would blur an exact match."""
    global _exact_prompts
    saved, _exact_prompts = _exact_prompts, True
    try:
        yield
    finally:
        _exact_prompts = saved


# Rows dequantized at once on the GEMM path: bounds the fp32 scratch (a 49k-row output head
# would otherwise need its whole fp32 copy).
_DEQUANT_ROWS = 4096


@dataclass
class GGUFWeight:
    """One block-quantized [out_features, in_features] matrix in ggml's layout."""

    data: torch.Tensor  # uint8 [out_features, row_bytes]
    qtype: int  # ggml type id
    in_features: int
    # int64 [in_features]: column j of the blocks multiplies activation column input_order[j]
    # (None: the identity). Set for GPTQ weights quantized in activation order (desc_act).
    input_order: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def type_name(self) -> str:
        return _TYPE_NAMES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @staticmethod
    def from_numpy(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GGUFWeight:
        """`raw`: the tensor's bytes as the file stores them (any shape); `shape`: (out, in)."""
        tid, block, block_bytes = GGUF_QUANT_TYPES[type_name]
        n, k = shape
        if k % block:
            raise ValueError(f"{type_name} rows of {k} values are not whole blocks of {block}")
        rows = np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // block * block_bytes)
        return GGUFWeight(torch.from_numpy(to_kernel_layout(rows, type_name)), tid, k)

    @property
    def interleaved(self) -> bool:
        return self.qtype in INTERLEAVED_TYPES.values()

    def interleave(self) -> GGUFWeight:
        """This weight as the CPU kernel runs it fastest: Q4_0/Q4_1/Q8_0 interleaved by 8 rows (same bytes;
        other types, and weights off the CPU, are returned as they are). Applied once the weight is
        final (after loading, concatenating and row selection: those work on plain rows)."""
        if self.qtype not in INTERLEAVED_TYPES or self.data.device.type != "cpu":
            return self
        data = _kernels().gguf_interleave(self.data, self.qtype, self.in_features)
        return GGUFWeight(data, INTERLEAVED_TYPES[self.qtype], self.in_features, self.input_order)

    def to(self, device: torch.device | str) -> GGUFWeight:
        """The same blocks on `device` (the loader moves each weight to the model's device)."""
        if self.interleaved and torch.device(device).type != "cpu":
            raise ValueError("a weight interleaved for the CPU kernel cannot move off the CPU")
        order = None if self.input_order is None else self.input_order.to(device)
        return GGUFWeight(self.data.to(device), self.qtype, self.in_features, order)

    def rows(self, index: torch.Tensor) -> GGUFWeight:
        """The rows `index` (a permutation or selection of output rows), still quantized."""
        if self.interleaved:
            raise ValueError("rows of a weight interleaved for the CPU kernel cannot be selected")
        return GGUFWeight(self.data[index].contiguous(), self.qtype, self.in_features, self.input_order)

    def columns(self, start: int, stop: int) -> GGUFWeight:
        """Input columns [start, stop) of every row, still quantized (a row-parallel shard under tensor
        parallelism): whole blocks only, so the shard's blocks are the file's blocks, byte for byte."""
        if self.interleaved:
            raise ValueError("columns of a weight interleaved for the CPU kernel cannot be selected")
        if self.input_order is not None:
            raise ValueError("columns of an activation-order (desc_act) weight are not contiguous blocks")
        _, block, block_bytes = GGUF_QUANT_TYPES[self.type_name]
        if start % block or stop % block or not 0 <= start < stop <= self.in_features:
            raise ValueError(f"{self.type_name} columns [{start}, {stop}) are not whole blocks of {block} "
                             f"within {self.in_features}")  # fmt: skip
        fields = _BLOCK_FIELDS.get(self.type_name)
        # Per row, each field's bytes for all blocks in turn (to_kernel_layout), or K-quants' whole blocks.
        sizes = [size for name in _KERNEL_ORDER for f, size in fields if f == name] if fields else [block_bytes]
        nb, b0, b1 = self.in_features // block, start // block, stop // block
        pieces, offset = [], 0
        for size in sizes:
            pieces.append(self.data[:, offset + b0 * size : offset + b1 * size])
            offset += nb * size
        return GGUFWeight(torch.cat(pieces, dim=1).contiguous(), self.qtype, stop - start)

    def padded_rows(self, rows: int) -> GGUFWeight:
        """This weight with zero rows appended up to `rows` (zero scales: they dequantize to zeros)."""
        if self.interleaved:
            raise ValueError("a weight interleaved for the CPU kernel cannot be padded")
        if rows <= self.out_features:
            return self
        zeros = self.data.new_zeros(rows - self.out_features, self.data.shape[1])
        return GGUFWeight(torch.cat([self.data, zeros]), self.qtype, self.in_features, self.input_order)

    def dequantize(self) -> torch.Tensor:
        """fp32 [out_features, in_features], columns in the activations' order."""
        w = _kernels().gguf_dequantize(self.data, self.qtype, self.in_features)
        if self.input_order is None:
            return w
        out = torch.empty_like(w)
        out[:, self.input_order] = w
        return out


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or torch.equal(a, b)


# Bytes per block of each field, in storage order, for the types whose rows the kernel regroups.
_BLOCK_FIELDS = {
    "Q4_0": (("d", 2), ("qs", 16)),
    "Q4_1": (("d", 2), ("m", 2), ("qs", 16)),
    "Q8_0": (("d", 2), ("qs", 32)),
}
_KERNEL_ORDER = ("qs", "d", "m")


def to_kernel_layout(rows: np.ndarray, type_name: str) -> np.ndarray:
    """[N, row_bytes] uint8 as stored -> the kernel's layout, same bytes (a new array).

    Q4_0/Q4_1/Q8_0 blocks interleave each block's fp16 scale (and min) with its quants; the
    kernel wants each row's quants first, then its scales, then its mins (gguf_quant_cpu.cpp
    says why). K-quants keep ggml's blocks."""
    fields = _BLOCK_FIELDS.get(type_name)
    if fields is None:
        return rows.copy()
    block_bytes = sum(size for _, size in fields)
    blocks = rows.reshape(rows.shape[0], -1, block_bytes)
    spans, start = {}, 0
    for name, size in fields:
        spans[name] = blocks[:, :, start : start + size].reshape(rows.shape[0], -1)
        start += size
    return np.concatenate([spans[name] for name in _KERNEL_ORDER if name in spans], axis=1)


def concat_rows(parts: list[GGUFWeight]) -> list[GGUFWeight]:
    """Stack consecutive parts of one type and input order into one matrix (a fused q/k/v of three
    Q4_1 tensors becomes one), keeping other parts apart. Parts with equal input orders end up
    sharing one order tensor, so gguf_linear gathers the activations once for them."""
    if any(p.interleaved for p in parts):
        raise ValueError("weights interleaved for the CPU kernel cannot be concatenated")
    merged: list[GGUFWeight] = []
    for part in parts:
        order = next((m.input_order for m in merged if _same_order(m.input_order, part.input_order)), part.input_order)
        if merged and merged[-1].qtype == part.qtype and _same_order(merged[-1].input_order, order):
            last = merged[-1]
            merged[-1] = GGUFWeight(torch.cat([last.data, part.data]), last.qtype, last.in_features, order)
        else:
            merged.append(GGUFWeight(part.data, part.qtype, part.in_features, order))
    return merged


def gguf_available() -> bool:
    return cpu_kernels() is not None


def gguf_cuda_available() -> bool:
    """Whether GGUF weights can run on CUDA: the Triton kernels (ferry/kernels/triton_gguf.py) import."""
    try:
        import ferry.kernels.triton_gguf  # noqa: F401
    except Exception:  # no triton, or one too old for the kernels
        return False
    return True


def _kernels():
    kernels = cpu_kernels()
    if kernels is None:
        raise RuntimeError("GGUF quantized weights need ferry's CPU kernels (a C++ compiler); use --quantization none")
    return kernels


# Set by the model's forward for the step it runs (the batch is decode rows first, then prompt
# rows): how many leading rows are decode tokens. None outside a step: rows are routed by count.
_step_decode_rows: int | None = None


@contextlib.contextmanager
def step_decode_rows(num_decodes: int) -> Iterator[None]:
    """Within a model step, route decode rows to the int8-dot kernel and prompt rows to the exact
    dequantize + GEMM path, whatever the batch holds. A prompt token then gets the same K/V and
    hidden states however its prompt is chunked, cached or split between a prefill and a decode
    worker; routing by row count instead made a prompt's last few tokens, recomputed on a PD
    decode worker, differ from the same prompt prefilled whole."""
    global _step_decode_rows
    saved, _step_decode_rows = _step_decode_rows, num_decodes
    try:
        yield
    finally:
        _step_decode_rows = saved


def current_step_decode_rows() -> int | None:
    """The leading decode rows of the model step being run (None outside one)."""
    return _step_decode_rows


def _int8_dot_rows(rows: int, qtype: int) -> int:
    """How many leading rows of a matmul take the int8-dot kernel (the rest: dequantize + GEMM)."""
    if _int8_everywhere or (qtype in INT8_PROMPT_TYPES and not _exact_prompts):
        return rows
    if _step_decode_rows is not None:
        return min(_step_decode_rows, rows)
    return rows if rows < GEMM_MIN_ROWS else 0


def gguf_matmul(x2: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """x2 [M, K] fp32 @ w.T -> [M, N]: the leading rows _int8_dot_rows picks through int8 dots, the rest
    exact."""
    kernels = _kernels()
    rows = x2.shape[0]
    int8_rows = _int8_dot_rows(rows, w.qtype)
    if int8_rows >= rows:
        return kernels.gguf_linear(x2, w.data, w.qtype, None)
    out = x2.new_empty(rows, w.out_features)
    if int8_rows:
        out[:int8_rows] = kernels.gguf_linear(x2[:int8_rows], w.data, w.qtype, None)
    exact = x2[int8_rows:]
    for n0 in range(0, w.out_features, _DEQUANT_ROWS):
        part = w.data[n0 : n0 + _DEQUANT_ROWS]
        weight = kernels.gguf_dequantize(part, w.qtype, w.in_features)
        out[int8_rows:, n0 : n0 + part.shape[0]] = exact @ weight.t()
    return out


def gguf_matmul_triton(x2: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """x2 [M, K] (bf16/fp16/fp32, columns already in w's input order) @ w.T -> [M, N] in x2's dtype, off
    the CPU, through the fused Triton kernels. No host sync, no branch on values: CUDA-graph capturable."""
    from ferry.kernels import triton_gguf

    if w.interleaved:
        raise ValueError(f"{w.type_name} is the CPU kernel's layout; the Triton kernels take ggml's rows")
    return triton_gguf.gguf_matmul(x2, w.data, w.qtype, w.in_features)


def gguf_linear(
    x: torch.Tensor, parts: list[GGUFWeight], bias: torch.Tensor | None, triton: bool | None = None
) -> torch.Tensor:
    """On the CPU, every row of a Q4_0/Q4_1/Q8_0 weight takes the int8 dots (INT8_PROMPT_TYPES). For the
    K-quants, inside a model step its decode rows do (step_decode_rows); outside one (the output head,
    direct calls) all rows do when there are fewer than GEMM_MIN_ROWS, else none.
    Off the CPU (weights on CUDA) every row takes the Triton kernels (gguf_matmul_triton); `triton`
    forces either path (the tests run the Triton one on CPU tensors, interpreted)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    on_cpu = x2.device.type == "cpu" if triton is None else not triton
    if on_cpu and x2.dtype != torch.float32:
        raise ValueError(f"GGUF quantized weights take float32 activations on the CPU, got {x2.dtype}")
    gathered: dict[int, torch.Tensor] = {}  # id(input_order) -> x2's columns in that order

    def inputs(w: GGUFWeight) -> torch.Tensor:
        if w.input_order is None:
            return x2
        key = id(w.input_order)
        if key not in gathered:
            gathered[key] = x2.index_select(1, w.input_order)
        return gathered[key]

    if on_cpu:
        ys = [gguf_matmul(inputs(w), w) for w in parts]
    else:
        ys = [gguf_matmul_triton(inputs(w), w) for w in parts]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    if bias is not None:
        y = y.add_(bias)
    return y.view(*lead, y.shape[-1])


def gguf_embedding(ids: torch.Tensor, w: GGUFWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` of a quantized embedding, dequantized to `dtype` (only those rows are read). On the CPU
    the C++ kernel (float32); off it, the gathered rows are dequantized by torch ops (graph-capturable)."""
    if w.input_order is not None:
        raise ValueError("a quantized embedding cannot have a permuted input order")
    flat = ids.reshape(-1).to(torch.int64)
    if w.data.device.type != "cpu":
        from ferry.kernels.triton_gguf import dequantize

        rows = dequantize(w.data.index_select(0, flat), w.qtype, w.in_features, dtype)
        return rows.view(*ids.shape, w.in_features)
    out = _kernels().gguf_get_rows(w.data, flat, w.qtype, w.in_features).view(*ids.shape, w.in_features)
    return out if dtype == torch.float32 else out.to(dtype)
