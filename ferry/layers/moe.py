"""Mixture-of-experts layers: the router's top-k choice, and the chosen experts run grouped.

A sparse block replaces the dense MLP by E experts (each a SwiGLU MLP) of which the router picks k
per token. `grouped_experts` sorts the (token, choice) pairs by expert, so each expert runs one GEMM
over all of its tokens, and sums the weighted outputs back per token: a step reads and multiplies
only the experts its tokens chose, so the cost per token follows the active parameters, not the
total. (A dense evaluation of every expert would cost E/k times more; HF's reference loops over
experts the same way.)

Under tensor parallelism every rank holds every expert, sharded as a dense MLP is: a slice of each
expert's intermediate (gate/up rows, down columns), so the block's output on a rank is a partial
sum that the caller all-reduces, with the shared expert's, in one collective. With expert
parallelism (`--enable-expert-parallel`) a rank holds num_experts / N whole experts instead (whole
GEMMs, no intermediate sliced thin) and runs the (token, choice) pairs routed to them: the tokens
are already on every rank (the attention is tensor-parallel), so the dispatch is a local selection
and the combine the same all-reduce; no all-to-all is needed while activations are replicated.

On CUDA the experts run in the fused Triton kernels instead (kernels/triton_moe.py: the pairs
aligned by expert in fixed-shape torch ops, one launch per GEMM for all experts), which need no
host sync, so MoE decode steps are captured in CUDA graphs like dense ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ferry.distributed.parallel_state import TensorParallel
from ferry.layers import gguf_linear as gguf
from ferry.layers.fused import silu_and_mul
from ferry.layers.linear import pack_weight, packed_linear


def triton_moe_available() -> bool:
    """Whether the fused-MoE Triton kernels (kernels/triton_moe.py) can run here (CUDA with triton)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    scoring: str = "softmax",
    num_groups: int = 1,
    topk_groups: int = 1,
    group_score: str = "max",
    score_bias: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]): the experts' scores in fp32 (softmax, or DeepSeek-V3's
    sigmoid), the top k, their weights renormalised to sum to one when `renormalize` (Mixtral;
    Qwen-MoE's norm_topk_prob), then times `scale` (DeepSeek's routed_scaling_factor).

    DeepSeek's grouped routing: the experts form `num_groups` groups, each scored by its best expert
    ("max", V2) or its best two summed ("top2_sum", V3), and a token picks its top k among the
    `topk_groups` best groups only. `score_bias` (V3's e_score_correction_bias) shifts the scores the
    choice is made on, not the weights."""
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if score_bias is None else scores + score_bias.float()
    if num_groups > 1:
        grouped = choice.view(choice.shape[0], num_groups, -1)
        if group_score == "max":
            per_group = grouped.amax(dim=-1)
        else:
            per_group = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = per_group.topk(topk_groups, dim=-1).indices
        keep = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scale != 1.0:
        weights = weights * scale
    return weights, ids


def _gguf_parts(rows: torch.Tensor, parts, bias: None) -> torch.Tensor:
    return gguf.gguf_linear(rows, parts if isinstance(parts, list) else [parts], None)


def grouped_experts(
    x: torch.Tensor,
    w13: list | torch.Tensor,
    w2: list | torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    packed: bool = False,
    linear: Callable | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, one GEMM pair per chosen expert.

    w13[e]: expert e's gate rows then up rows [2I, H]; w2[e]: its down projection [H, I] (oneDNN-packed
    copies when `packed`; with `linear=_gguf_parts`, GGUF blocks: w13[e] its [gate, up] parts). x:
    [T, H]; weights, ids: [T, k]. Ids outside [0, len(w13)) are skipped (under expert parallelism:
    experts another rank holds).

    GGUF blocks inside a model step: an expert's rows keep the batch's token order (the sort is
    stable), so its decode rows come first, and the K-quants route that many through the int8 dots as
    a dense layer does (gguf_linear.step_decode_rows), whatever experts the rows were grouped into."""
    k, num = ids.shape[1], len(w13)
    flat = ids.reshape(-1)
    flat = torch.where((flat >= 0) & (flat < num), flat, num)  # another rank's experts: sorted last, dropped
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(flat, minlength=num + 1).tolist()  # host sync (CUDA graphs need the kernel)
    order = order[: len(order) - counts[num]]
    token = order // k
    rows = x.index_select(0, token)
    out = torch.empty_like(rows)
    step_decodes = gguf.current_step_decode_rows() if linear is _gguf_parts else None
    decode = (token < step_decodes).tolist() if step_decodes is not None else None
    linear = linear or (packed_linear if packed else F.linear)
    start = 0
    for e, n in enumerate(counts[:num]):
        if n:
            end = start + n
            routing = gguf.step_decode_rows(sum(decode[start:end])) if decode else contextlib.nullcontext()
            with routing:
                h = silu_and_mul(linear(rows[start:end], w13[e], None))
                out[start:end] = linear(h, w2[e], None)
            start = end
    out.mul_(weights.reshape(-1).index_select(0, order).to(out.dtype).unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, token, out)


class FusedMoE(nn.Module):
    """One layer's routed experts, stacked: w13 [E, 2 I, H] (each expert's gate rows, then its up
    rows) and w2 [E, H, I]. Under tensor parallelism, I is this rank's slice of moe_intermediate_size
    and E every expert; with `expert_parallel`, E is this rank's num_experts / N whole experts
    (from `first_expert` on) and I the whole width. `forward` returns this rank's partial sum (the
    caller all-reduces): the tokens are on every rank, so each runs the pairs routed to its experts.

    A GGUF's quantized experts (on the CPU) keep their blocks instead, as the only copy: gguf13[e] is
    expert e's [gate, up] GGUFWeights, gguf2[e] its down one (`drop_weights` before allocation, then
    `load_gguf`), run by grouped_experts through the GGUF kernels."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel,
                 expert_parallel: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts  # in the layer, on all ranks
        self.hidden_size = hidden_size
        self.expert_parallel = expert_parallel and tp.size > 1
        if self.expert_parallel:
            local = tp.shard(num_experts, "num_experts (expert parallel)")
            self.first_expert, self.intermediate = tp.rank * local, intermediate_size
        else:
            local, self.first_expert = num_experts, 0
            self.intermediate = tp.shard(intermediate_size, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(local, 2 * self.intermediate, hidden_size))
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, self.intermediate))
        # pack(): per-expert oneDNN copies, then the only copies (the stacked parameters are freed).
        self.packed13: list[torch.Tensor] | None = None
        self.packed2: list[torch.Tensor] | None = None
        self.gguf13: list[list] | None = None  # per expert [gate, up] GGUFWeights (drop_weights)
        self.gguf2: list | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.first_expert:
            ids = ids - self.first_expert  # this rank's experts from 0; the others fall outside and are skipped
        if self.packed13 is not None:
            return grouped_experts(x, self.packed13, self.packed2, weights, ids, packed=True)
        if self.gguf13 is not None:
            return grouped_experts(x, self.gguf13, self.gguf2, weights, ids, linear=_gguf_parts)
        if x.is_cuda and triton_moe_available():  # two launches, no host sync: CUDA graphs capture it
            from ferry.kernels.triton_moe import fused_experts

            return fused_experts(x, self.w13, self.w2, weights, ids, experts_in_layer=self.num_experts)
        return grouped_experts(x, self.w13, self.w2, weights, ids)

    def _intermediate_split(self) -> tuple[int, int]:
        """(ranks that split each expert's intermediate, this rank's slice): the TP size and rank, or
        (1, 0) under expert parallelism, which keeps experts whole."""
        return (1, 0) if self.expert_parallel else (self.tp.size, self.tp.rank)

    def drop_weights(self) -> None:
        """On a meta model, before allocation: the experts will come as GGUF blocks (`load_gguf`), the
        only copy; no float weight is ever allocated."""
        local = self.w13.shape[0]
        self.w13 = self.w2 = None
        self.gguf13 = [[None, None] for _ in range(local)]
        self.gguf2 = [None] * local

    def load_gguf(self, part: str, expert: int | None, w) -> None:
        """A GGUFWeight of one expert's projection, or of every expert's stacked by rows (GGUF's *_exps
        as [E x rows, in]), full size: this rank takes its experts and its slice of each, as `load`."""
        if part not in ("gate", "up", "down"):
            raise ValueError(f"unknown expert projection {part!r}")
        n, rank = self._intermediate_split()
        inter = self.intermediate
        rows = inter * n if part in ("gate", "up") else self.hidden_size  # one expert's, full size
        if w.out_features != rows * (1 if expert is not None else self.num_experts):
            raise ValueError(f"expert {part} blocks: {w.out_features} rows, expected {rows} per expert")
        local = len(self.gguf2)
        for e in range(local) if expert is None else [expert - self.first_expert]:
            if not 0 <= e < local:
                return  # another rank's expert
            g = self.first_expert + e
            one = w if expert is not None else w.rows(slice(g * rows, (g + 1) * rows))
            if part == "down":  # input columns split under TP (whole blocks: checked by plan_gguf)
                self.gguf2[e] = one if n == 1 else one.columns(rank * inter, (rank + 1) * inter)
            else:
                self.gguf13[e][0 if part == "gate" else 1] = (
                    one if n == 1 else one.rows(slice(rank * inter, (rank + 1) * inter))
                )

    def pack(self) -> None:
        """oneDNN-packed fp32 copies of every expert's matrices (CPU), as Linear.pack does for dense ones;
        GGUF experts interleaved for the CPU kernel."""
        if self.gguf13 is not None:  # gate and up of one type as one matrix: one kernel call, no concatenation
            self.gguf13 = [[p.interleave() for p in gguf.concat_rows(parts)] for parts in self.gguf13]
            self.gguf2 = [p.interleave() for p in self.gguf2]
            return
        if self.packed13 is not None:
            return
        self.packed13 = [pack_weight(w) for w in self.w13]
        self.packed2 = [pack_weight(w) for w in self.w2]
        self.w13 = self.w2 = None

    @torch.no_grad()
    def load(self, part: str, expert: int | None, tensor: torch.Tensor) -> None:
        """Copy in one checkpoint tensor, full size (this rank takes its slice): `part` is "gate", "up"
        or "down"; `expert` its index, or None for all experts stacked [E, ...] (GGUF's *_exps). Under
        expert parallelism another rank's expert is passed over."""
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the layer has {self.num_experts}")
        local = self.w13.shape[0]
        if expert is None:
            if tensor.shape[0] != self.num_experts:
                raise ValueError(
                    f"stacked expert {part} projection: {tensor.shape[0]} experts, expected {self.num_experts}"
                )
            tensor, experts = tensor[self.first_expert : self.first_expert + local], slice(None)
        else:
            expert -= self.first_expert
            if not 0 <= expert < local:
                return  # another rank's
            tensor, experts = tensor.unsqueeze(0), slice(expert, expert + 1)
        # Tensor parallelism slices every expert's intermediate; expert parallelism keeps it whole.
        n, rank = self._intermediate_split()
        inter = self.intermediate
        if part in ("gate", "up"):
            want = (tensor.shape[0], inter * n, self.w13.shape[2])
            if tuple(tensor.shape) != want:
                raise ValueError(f"expert {part} projection: shape {tuple(tensor.shape)} != expected {want}")
            offset = 0 if part == "gate" else inter
            self.w13[experts, offset : offset + inter].copy_(tensor[:, rank * inter : (rank + 1) * inter])
        elif part == "down":
            want = (tensor.shape[0], self.w2.shape[1], inter * n)
            if tuple(tensor.shape) != want:
                raise ValueError(f"expert down projection: shape {tuple(tensor.shape)} != expected {want}")
            self.w2[experts].copy_(tensor[:, :, rank * inter : (rank + 1) * inter])
        else:
            raise ValueError(f"unknown expert projection {part!r}")
