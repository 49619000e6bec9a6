"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), and their mixtures of
experts: Mixtral, Qwen2-MoE (a gated shared expert), Qwen3-MoE (layers/moe.py runs the experts);
DeepSeek-V2/V3, the same decoder with multi-head latent attention (layers/mla.py) and grouped routing;
and Gemma 2/3: local (sliding-window) and global layers, GeGLU, (1 + w) norms around each sublayer
(sandwich norms), a scaled embedding, Gemma 2's soft-capped attention scores and logits, Gemma 3's
q/k norms and its local layers' own rotary base.

Inputs are one flat batch of tokens (no padding) with their positions and
the attention metadata; K/V go through the paged cache. q/k/v and gate/up
projections are fused into one matmul each (loaded from the separate
checkpoint tensors), which matters on CPUs where small GEMMs are inefficient.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from collections import Counter
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ferry.distributed.parallel_state import SINGLE, SINGLE_STAGE, PipelineStage, TensorParallel
from ferry.kv_quant import row_width
from ferry.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    one_prompt_metadata,
    one_sequence_decode_metadata,
    paged_attention,
    select_attention_backend,
)
from ferry.layers.fused import act_and_mul
from ferry.layers.gguf_linear import (
    GGUF_QUANT_TYPES,
    GGUFWeight,
    exact_prompt_rows,
    gguf_embedding,
    gguf_linear,
    step_decode_rows,
)
from ferry.layers.int8_linear import Int8Rows, Int8Weight, int8_linear, pack_int8_weight
from ferry.layers.linear import Linear, pack_weight, packed_linear
from ferry.layers.lora import lora_active
from ferry.layers.mla import MLAAttention
from ferry.layers.moe import FusedMoE, select_experts
from ferry.layers.norm import RMSNorm
from ferry.layers.rotary import RotaryEmbedding
from ferry.layers.smoothquant import (
    DEFAULT_ALPHA,
    record_input_absmax,
    smoothing_factors,
    smoothing_factors_from_maxima,
    weight_column_absmax,
)
from ferry.models.config import O_PROJ_BIAS_ARCHITECTURES, ModelConfig
from ferry.utils import lazy_zeros

logger = logging.getLogger(__name__)

# An expert's projection: `layers.L.mlp.experts.E.<part>.weight` (HF; Mixtral says w1/w3/w2), or all of a
# layer's experts stacked [E, ...] without the index (GGUF's ffn_*_exps).
_EXPERT_WEIGHT = re.compile(r"layers\.(?P<layer>\d+)\.mlp\.experts\.(?:(?P<expert>\d+)\.)?(?P<part>\w+)\.weight")
_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_LAYER_PREFIX = re.compile(r"(?:model\.)?layers\.(\d+)\.")


class Attention(nn.Module):
    """q/k/v column-parallel by heads, o_proj row-parallel (its partial sums all-reduced). `window`:
    this layer's sliding window (None: global)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel,
                 window: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp
        self.num_heads = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = tp.kv_heads(cfg.num_key_value_heads)  # replicated when fewer than the ranks
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Llama's (and Gemma's) attention_bias covers o_proj too; Qwen2's q/k/v bias does not.
        o_bias = cfg.attention_bias and cfg.architecture in O_PROJ_BIAS_ARCHITECTURES
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = window
        self.softcap = cfg.attn_logit_softcapping

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, self.softcap)
        return self.tp.all_reduce(self.o_proj(o.reshape(T, self.q_size)))


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel. `reduce=False` leaves the partial sums to the caller."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, intermediate_size: int | None = None,
                 reduce: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        self.act = cfg.hidden_act
        self.intermediate = tp.shard(intermediate_size or cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))
        return self.tp.all_reduce(out) if self.reduce else out


class Router(nn.Module):
    """A sparse block's router: one logit per expert (replicated under TP), and DeepSeek-V3's
    per-expert bias on the scores the choice is made on."""

    def __init__(self, hidden_size: int, num_experts: int, score_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if score_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """The MLP of a mixture-of-experts layer (Mixtral's block_sparse_moe, Qwen-MoE's and DeepSeek's
    mlp): a router (`gate`), the routed experts, and the shared experts every token takes: Qwen2-MoE's
    one, scaled by a sigmoid gate, or DeepSeek's ungated ones (one MLP as wide as all of them). The
    ranks' partial sums of both are all-reduced once."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, expert_parallel: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.routing = dict(scoring=cfg.moe_scoring, num_groups=cfg.moe_n_group, topk_groups=cfg.moe_topk_group,
                            group_score=cfg.moe_group_score, scale=cfg.routed_scaling_factor)  # fmt: skip
        self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.moe_score_bias)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp, expert_parallel)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, tp, cfg.shared_expert_intermediate_size, reduce=False)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize,
                                      score_bias=self.gate.e_score_correction_bias, **self.routing)  # fmt: skip
        out = self.experts(x, weights, ids)
        if self.shared_expert_gate is not None:
            # The gate is replicated, so scaling each rank's partial sum scales the reduced one.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.tp.all_reduce(out)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds ceil(vocab / tp) consecutive rows; a token's row comes from the rank
    that holds it (the others contribute zeros to the all-reduce)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
        # nn.Embedding's initialisation (loading overwrites it). Not on the meta device the loader
        # builds models on: there it fills nothing, yet torch's meta path imports torch._dynamo
        # (~1.5 s of every server's start).
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight)
        self.gguf: GGUFWeight | None = None  # --quantization gguf: the only copy (weight is None)
        self.gguf_dtype = torch.float32  # the rows' dtype out of self.gguf (the model's; set by the loader)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = self._rows(local.clamp(0, self.rows - 1))
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf is not None:
            return gguf_embedding(ids, self.gguf, self.gguf_dtype)
        return F.embedding(ids, self.weight)


class DecoderLayer(nn.Module):
    """Pre-norm: residual + attn(norm(x)), then residual + mlp(norm(x)). With sandwich norms (Gemma),
    each sublayer's output is normed again before it joins the residual: post_attention_layernorm
    norms the attention's output and pre_feedforward_layernorm the MLP's input (the role
    post_attention_layernorm has without them), post_feedforward_layernorm the MLP's output."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, index: int,
                 expert_parallel: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_mla:
            self.self_attn = MLAAttention(cfg, rotary, tp)
        else:
            self.self_attn = Attention(cfg, rotary, tp, cfg.layer_window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg, tp, expert_parallel) if index in cfg.moe_layers else MLP(cfg, tp)

    def forward(self, x, residual, positions, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output, not yet added to `residual` (None for the first
        layer, whose x is the embedding). Returns this layer's MLP output and the residual."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, positions, kv_cache, meta)
        if self.pre_feedforward_layernorm is None:
            return self.mlp(self.post_attention_layernorm.add_and_norm(h, residual)), residual
        h = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, tp: TensorParallel = SINGLE,
                 expert_parallel: bool = False, pp: PipelineStage = SINGLE_STAGE) -> None:  # fmt: skip
        """`expert_parallel`: under TP, each rank holds whole experts, num_experts / N of them
        (layers/moe.py), instead of a slice of every one. `pp`: this rank's pipeline stage: only its
        decoder layers (`self.layers[i]` is checkpoint layer `first_layer + i`), the embedding and the
        output head on stage 0 only (None elsewhere); the final norm is small and kept everywhere."""
        super().__init__()
        self.config = cfg
        self.max_position = max_position
        self.tp = tp
        self.pp = pp
        own = pp.layer_range(cfg.num_hidden_layers)
        self.first_layer = own.start
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if pp.is_first else None
        rotary = self._rotary_by_layer()
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary[i], tp, i, expert_parallel) for i in own)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        vocab_rows = -(-cfg.vocab_size // tp.size)  # the output head is vocab-parallel like the embedding
        untied = not cfg.tie_word_embeddings and pp.is_first
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_rows, bias=False) if untied else None
        self._packed_lm_head: torch.Tensor | None = None
        self._int8_lm_head: Int8Weight | Int8Rows | None = None
        self._gguf_lm_head: GGUFWeight | None = None
        self.quantization: str | None = None  # set by the loader: "gguf", "int8" or None (the dtype)
        # Set by the loader where it applies: decode-only steps in one C++ call (cpu_decode_step.py).
        self.cpu_decode_step = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        pre_norm: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final (normed) hidden states [T, hidden]. A pipeline stage after the first starts from
        the previous stage's `intermediate` (its last layer's output and the residual, unsummed), and
        a stage before the last returns that pair instead. `intermediate` = (stream, None) starts
        from the residual stream itself (early exit: `last_layers` verifies from where
        `first_layers` drafted). `pre_norm`: (the normed states, the residual stream before the
        final norm), the stream being what `last_layers` starts from."""
        stream_only = intermediate is None or intermediate[1] is None
        if (self.cpu_decode_step is not None and stream_only and not lora_active()
                and self.cpu_decode_step.runs(kv_caches, meta)):  # fmt: skip
            hidden = None if intermediate is None else intermediate[0]
            return self.cpu_decode_step(input_ids, positions, kv_caches, meta, hidden, pre_norm)
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
            if self.config.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to the activations' dtype as HF does
                x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        else:
            x, residual = intermediate
        with step_decode_rows(meta.num_decodes):  # GGUF weights: decode rows int8 dots, prompt rows exact
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(x, residual, positions, kv_cache, meta)
        if not self.pp.is_last:
            return x, residual
        out = self.norm.add_and_norm(x, residual)  # residual += x, in place: the stream
        return (out, residual) if pre_norm else out

    def first_layers(self, num_layers: int) -> LlamaForCausalLM:
        """This model cut after its first `num_layers` layers, then its final norm and LM head,
        sharing every weight (no copy): early-exit self-speculation's draft (LayerSkip). Its
        C++ decode step, which holds its own layer list, is the caller's to build."""
        cfg = self.config
        if not 1 <= num_layers < cfg.num_hidden_layers:
            raise ValueError(f"draft_layers must be in [1, {cfg.num_hidden_layers - 1}], got {num_layers}")
        view = self._view_of_layers(self.layers[:num_layers])
        view.config = dataclasses.replace(
            cfg, num_hidden_layers=num_layers, moe_layers=tuple(i for i in cfg.moe_layers if i < num_layers)
        )
        return view

    def last_layers(self, first: int) -> LlamaForCausalLM:
        """This model's layers from `first` on, then its final norm and LM head, sharing every
        weight: what early exit's verification runs over the residual stream `first_layers(first)`
        left (`forward(..., intermediate=(stream, None))`), reusing the K/V its draft wrote for
        the first layers. Its kv_caches are the model's from `first` on; its C++ decode step is
        the caller's to build."""
        cfg = self.config
        if not 1 <= first < cfg.num_hidden_layers:
            raise ValueError(f"the first layer must be in [1, {cfg.num_hidden_layers - 1}], got {first}")
        view = self._view_of_layers(self.layers[first:])
        view.first_layer = self.first_layer + first
        return view

    def _view_of_layers(self, layers: nn.ModuleList) -> LlamaForCausalLM:
        """This model over `layers` only, sharing every parameter (its own module table, no C++
        decode step: that holds its own layer list)."""
        view = copy.copy(self)
        view._modules = dict(self._modules)
        view.layers = nn.ModuleList(layers)
        view.cpu_decode_step = None
        return view

    def _rotary_by_layer(self) -> list[RotaryEmbedding]:
        """Each layer's cos/sin tables (fp32, on the default device): one table shared by every layer,
        or, for Gemma 3, a second for its sliding layers (their own base, unscaled)."""
        cfg = self.config
        # (the served context may pass the trained one: dynamic and YaRN scaling stretch from the latter)
        rotary = RotaryEmbedding(cfg.head_dim, self.max_position, cfg.rope_theta, cfg.rope_scaling,
                                 cfg.max_position_embeddings)  # fmt: skip
        local = rotary
        if cfg.local_rope_theta is not None:
            local = RotaryEmbedding(cfg.head_dim, self.max_position, cfg.local_rope_theta, None)
        return [local if cfg.layer_window(i) is not None else rotary for i in range(cfg.num_hidden_layers)]

    def init_rotary(self) -> None:
        """(Re)build the fp32 cos/sin tables on the model's device, shared by the layers."""
        with torch.device(self.norm.weight.device):
            rotary = self._rotary_by_layer()
        for i, layer in enumerate(self.layers):
            layer.self_attn.rotary = rotary[self.first_layer + i]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._gathered_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _gathered_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head's logits, all-gathered over tensor-parallel ranks (no soft-capping)."""
        logits = self._local_logits(hidden)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last_dim(logits)[:, : self.config.vocab_size]
        return logits

    @torch.no_grad()
    def dense_lm_head(self) -> torch.Tensor:
        """The output head as a dense fp32 [vocab, hidden] matrix, however it is stored (GGUF blocks,
        int8, oneDNN-packed, sharded): its logits of the identity, on the exact path. What heads
        trained on top of it (ferry train-draft) differentiate through."""
        eye = torch.eye(self.config.hidden_size, device=self.norm.weight.device, dtype=self.norm.weight.dtype)
        with exact_prompt_rows():
            return self._gathered_logits(eye).float().t().contiguous()[: self.config.vocab_size]

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._gguf_lm_head is not None:
            return gguf_linear(hidden, [self._gguf_lm_head], None)
        if self._int8_lm_head is not None:
            return int8_linear(hidden, self._int8_lm_head, None)
        if self._packed_lm_head is not None:
            return packed_linear(hidden, self._packed_lm_head, None)
        return F.linear(hidden, self._lm_head_weight())

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_linear_weights(self) -> None:
        """Switch every projection (and the output head) to oneDNN-packed fp32 weights (CPU);
        GGUF-quantized ones to the CPU kernel's layout (Linear.pack)."""
        for module in self.modules():
            if isinstance(module, (Linear, FusedMoE)):
                module.pack()
        if not self.pp.is_first:
            return  # the output head is stage 0's
        if self._gguf_lm_head is None:
            if self._packed_lm_head is None:
                self._packed_lm_head, self._int8_lm_head = pack_weight(self._lm_head_weight()), None
            # An untied head's packed copy is its only copy; a tied one keeps the embedding table for
            # the lookups beside the packed head (oneDNN's layout cannot be gathered by row), a
            # trade of one table for a 2x faster head GEMV here (BENCHMARKS.md, issue 15 fourth part).
            if self.lm_head is not None:
                self.lm_head.weight = None
        else:
            head = self._gguf_lm_head.interleave()
            if self.embed_tokens.gguf is self._gguf_lm_head:  # tied: still one copy for both
                self.embed_tokens.gguf = head
            self._gguf_lm_head = head

    # -- GGUF quantized weights (--quantization gguf) ----------------------

    def plan_gguf(self, quantized: dict[str, str], experts: bool = False) -> frozenset[str]:
        """On the meta model, before allocation: give up the fp32 weight of every projection, the
        embedding and the head whose checkpoint tensors are all stored quantized (`quantized`:
        HF name -> ggml type), so the GGUF bytes are the only copy; with `experts` (the CPU kernels),
        a mixture of experts' experts too. Returns the checkpoint names the loader must hand over
        still quantized; the rest it dequantizes as before."""
        keep: set[str] = set()
        pieces: dict[str, list[str]] = {}  # module (HF-fused name) -> its checkpoint tensor names
        expert_names: dict[int, list[str]] = {}  # this stage's layer -> its experts' quantized tensor names
        for name in quantized:
            short = self._stage_name(name.removeprefix("model."))
            if short is None:  # another pipeline stage's
                continue
            match = _EXPERT_WEIGHT.fullmatch(short)
            if match is not None:
                expert_names.setdefault(int(match["layer"]), []).append(name)
                continue
            parts = short.split(".")
            module = ".".join(self._FUSED.get(p, (p, 0))[0] for p in parts[:-1])
            pieces.setdefault(module, []).append(name)
        modules = dict(self.named_modules())
        for module_name, names in pieces.items():
            module = modules.get(module_name)
            if isinstance(module, Linear):
                fused = module_name.rsplit(".", 1)[-1]
                need = self._FUSED_PARTS.get(fused, 1)
                splits = all(self._shards_into_blocks(module, quantized[n]) for n in names)
                if self._SHARDING.get(fused) == "row" and not splits:
                    logger.info("%s: its input columns do not split into whole blocks over %d ranks; "
                                "dequantized", module_name, self.tp.size)  # fmt: skip
                    continue
                if len(names) == need:  # every part quantized, else all of them come dequantized
                    module.drop_weight()
                    keep.update(names)
            elif module_name == "embed_tokens" and self.embed_tokens is not None:
                self.embed_tokens.weight = None
                keep.update(names)
            elif module_name == "lm_head" and self.lm_head is not None:
                self.lm_head.weight = None
                keep.update(names)
        for layer, names in expert_names.items():
            if experts and self._experts_stay_quantized(layer, names, quantized):
                self.layers[layer].mlp.experts.drop_weights()
                keep.update(names)
        return frozenset(keep)

    def _experts_stay_quantized(self, layer: int, names: list[str], quantized: dict[str, str]) -> bool:
        """Whether layer `layer`'s experts can run as their blocks: all of them quantized (stacked as
        three tensors, or three per expert) in types the kernels run, each rank's slice of the down
        projection's input whole blocks."""
        block = self.layers[layer].mlp
        if not isinstance(block, SparseMoeBlock) or any(quantized[n] not in GGUF_QUANT_TYPES for n in names):
            return False
        if len(names) not in (3, 3 * self.config.num_experts):
            return False
        experts = block.experts
        parts = [_EXPERT_PARTS.get(_EXPERT_WEIGHT.fullmatch(self._stage_name(n.removeprefix("model.")))["part"])
                 for n in names]  # fmt: skip
        if sorted(set(parts)) != ["down", "gate", "up"]:
            return False
        down = {quantized[n] for n, part in zip(names, parts) if part == "down"}
        if not experts.expert_parallel and self.tp.size > 1:
            if any(experts.intermediate % GGUF_QUANT_TYPES[t][1] for t in down):
                logger.info("layer %d's experts: their down projections' columns do not split into whole blocks "
                            "over %d ranks; dequantized", layer, self.tp.size)  # fmt: skip
                return False
        return True

    def quantize_linear_weights_int8(
        self, calibration_ids: list[int], alpha: float = DEFAULT_ALPHA, triton: bool | None = None
    ) -> None:
        """Switch every projection and the output head to int8 weights with per-token int8
        activations (`--quantization int8`: oneDNN on the CPU, the Triton kernels on CUDA or where
        `triton`), after SmoothQuant smoothing. The output head is quantized too: it is the largest
        matrix of a small model, and llama.cpp's GGUFs keep it in Q8_0 for the same trade."""
        head = self.smooth_for_int8(calibration_ids, alpha)
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize_int8(triton)
        self._packed_lm_head, self._int8_lm_head = None, pack_int8_weight(head, triton)
        if self.lm_head is not None:  # the int8 copy is the head's only one (a tied table stays for lookups)
            self.lm_head.weight = None

    @torch.no_grad()
    def smooth_for_int8(self, calibration_ids: list[int], alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
        """SmoothQuant (layers/smoothquant.py), calibrated by one forward pass over `calibration_ids`.

        Folds 1/s into the RMSNorm weights and the up projection's rows, and s into the
        projections' columns: the fp32 model computes the same function, with smaller
        activation outliers. The output head may share its weight with the embedding, so its
        smoothed weight is returned as a copy that must replace the head's weight from now on
        (the final norm divides by s)."""
        targets: dict[str, nn.Module] = {}
        for i, layer in enumerate(self.layers):
            targets[f"{i}.qkv"] = layer.self_attn.qkv_proj
            targets[f"{i}.gate_up"] = layer.mlp.gate_up_proj
            targets[f"{i}.down"] = layer.mlp.down_proj
        with record_input_absmax(targets) as absmax:
            hidden = self._forward_prompt(calibration_ids)

        def column_parallel_factors(act_absmax: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            # Under TP this rank holds some of the weight's rows (its input, hence act_absmax, is whole
            # on every rank). Each rank's own maxima would be exact too (its norm copy feeds only its
            # rows), but the maxima over all ranks give TP=1's s: a shard's int8 rows are TP=1's rows.
            w_absmax = self.tp.all_reduce_max(weight_column_absmax(weight))
            return smoothing_factors_from_maxima(act_absmax, w_absmax, alpha)

        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            s = column_parallel_factors(absmax[f"{i}.qkv"], attn.qkv_proj.weight)
            layer.input_layernorm.weight.div_(s)
            attn.qkv_proj.weight.mul_(s)
            s = column_parallel_factors(absmax[f"{i}.gate_up"], mlp.gate_up_proj.weight)
            layer.post_attention_layernorm.weight.div_(s)
            mlp.gate_up_proj.weight.mul_(s)
            # down_proj's input is silu(gate) * up: linear in up, so up's rows take the division.
            # (Row-parallel: this rank's input channels are its own, and it holds their whole columns.)
            s = smoothing_factors(absmax[f"{i}.down"], mlp.down_proj.weight, alpha)
            mlp.gate_up_proj.weight[mlp.intermediate :].div_(s[:, None])
            mlp.down_proj.weight.mul_(s)
        head = self._lm_head_weight()  # vocab-parallel: this rank's rows
        s = column_parallel_factors(hidden.abs().amax(dim=0), head)
        self.norm.weight.div_(s)
        return head * s

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """A zeroed paged KV cache for this rank: per layer a (K, V) pair of [num_blocks, block_size,
        kv_heads, width] tensors (width + 4 when quantized: each row's fp32 scale follows its values).
        MLA caches one row per token (latent and rotary key), its pair being that one tensor twice."""
        attn = self.layers[0].self_attn
        shape = (num_blocks, block_size, attn.num_kv_heads, row_width(self.config.kv_cache_width, dtype))
        caches = []
        for _ in self.layers:  # on the CPU, pages that cost nothing until a request writes them
            k = lazy_zeros.zeros(shape, dtype, device)
            caches.append((k, k if self.config.is_mla else lazy_zeros.zeros(shape, dtype, device)))
        return caches

    def attention_backend(
        self, name: str, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype
    ) -> AttentionBackend:
        """The attention backend `name` ("auto": the one that fits) for this model's (this rank's)
        heads, activations of `dtype` and a cache of `cache_dtype`."""
        attn = self.layers[0].self_attn
        return select_attention_backend(
            name,
            device,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=dtype,
            cache_dtype=cache_dtype,
            latent=self.config.is_mla,
        )

    @torch.no_grad()
    def _forward_prompt(self, token_ids: list[int], kv_cache_dtype: torch.dtype | None = None,
                        decode_rows: bool = False, engine_kernels: bool = False) -> torch.Tensor:  # fmt: skip
        """Final hidden states [T, hidden] of one prompt, with a throwaway KV cache (calibration; `ferry bench
        quality`, where a quantized `kv_cache_dtype` makes every position attend to quantized K/V).
        By default on the reference attention backend (exact: what the others are measured against);
        `engine_kernels`: on the backend an engine picks (on the CPU, its C++ prefill attention),
        in the engine's block size; `decode_rows`: every token a decode row of the one sequence (the
        decode kernels' arithmetic; the engine's backend too)."""
        device, dtype = self.norm.weight.device, self.norm.weight.dtype
        cache_dtype = kv_cache_dtype or dtype
        T = len(token_ids)
        if not (decode_rows or engine_kernels):
            kv = self.new_kv_cache(T, 1, cache_dtype, device)  # T blocks of one slot each
            meta, positions = one_prompt_metadata(T, device)
            return self(torch.tensor(token_ids, device=device), positions, kv, meta)
        bs = 16  # the engine's default block size
        kv = self.new_kv_cache(-(-T // bs), bs, cache_dtype, device)
        backend = self.attention_backend("auto", device, dtype, cache_dtype)  # as an engine picks it
        if decode_rows:
            meta, positions = one_sequence_decode_metadata(T, bs, device, backend)
        else:
            meta, positions = one_prompt_metadata(T, device, backend, bs)
        return self(torch.tensor(token_ids, device=device), positions, kv, meta)

    # -- weights --------------------------------------------------------

    def _has_gguf(self, module: nn.Module) -> bool:
        if module is self.lm_head:
            return self._gguf_lm_head is not None
        return getattr(module, "gguf", None) is not None

    def _set_gguf_weights(self, gguf_parts: dict[str, dict[int, GGUFWeight]]) -> None:
        modules = dict(self.named_modules())
        for module_name, shards in gguf_parts.items():
            module = modules.get(module_name)
            parts = [shards[i] for i in sorted(shards)]
            if isinstance(module, Linear) and module.weight is None:
                n = self._FUSED_PARTS.get(module_name.rsplit(".", 1)[-1], 1)
                if len(parts) != n:
                    raise ValueError(f"{module_name}: {len(parts)} of its {n} quantized parts in the checkpoint")
                module.set_gguf(parts)
            elif module_name == "embed_tokens" and self.embed_tokens is not None and self.embed_tokens.weight is None:
                self.embed_tokens.gguf, self.embed_tokens.gguf_dtype = parts[0], self.norm.weight.dtype
            elif module_name == "lm_head" and self.lm_head is not None and self.lm_head.weight is None:
                self._gguf_lm_head = parts[0]
            else:
                raise ValueError(f"quantized checkpoint tensor for {module_name!r}, which expects a float weight")
        if self.lm_head is None and self.embed_tokens is not None and self.embed_tokens.gguf is not None:
            self._gguf_lm_head = self.embed_tokens.gguf  # tied: one quantized copy serves both

    def _load_expert_weight(self, match: re.Match, tensor: torch.Tensor) -> list[str]:
        """Copy one expert's projection (or every expert's, stacked) into its layer's FusedMoE. Always
        float, or GGUF blocks where `plan_gguf` kept the experts quantized."""
        layer, expert, part = int(match["layer"]), match["expert"], _EXPERT_PARTS.get(match["part"])
        experts = self.layers[layer].mlp.experts if layer < len(self.layers) else None
        if part is None or not isinstance(experts, FusedMoE):
            raise ValueError(f"checkpoint tensor {match.string!r} has no place in {type(self).__name__}")
        index = None if expert is None else int(expert)
        if isinstance(tensor, GGUFWeight):
            experts.load_gguf(part, index, tensor)
        else:
            experts.load(part, index, tensor.to(self.norm.weight.device))
        indices = range(experts.num_experts) if expert is None else [int(expert)]
        return [f"layers.{layer}.mlp.experts.{part}#{e}" for e in indices]

    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Checkpoint tensors per fused module: {"qkv_proj": 3, "gate_up_proj": 2}.
    _FUSED_PARTS = dict(Counter(fused for fused, _ in _FUSED.values()))

    # How each module's checkpoint tensors shard over tensor-parallel ranks (Megatron-style); the
    # rest (norms) is replicated. Read by both the float and the block slicers below.
    _SHARDING = {
        "qkv_proj": "column",  # output rows (whole heads) split
        "gate_up_proj": "column",
        "o_proj": "row",  # input columns split, an all-reduce after
        "down_proj": "row",
        "embed_tokens": "vocab",  # ceil(V / N) rows per rank, the last shard zero-padded
        "lm_head": "vocab",
        # MLA: its heads' query and kv_b rows split (whole heads), the latent's projections replicated.
        "q_proj": "column",
        "q_b_proj": "column",
        "kv_b_proj": "column",
    }

    def _shards_into_blocks(self, module: Linear, type_name: str) -> bool:
        """Whether this rank's input columns of a row-parallel module are whole blocks of `type_name`."""
        block = GGUF_QUANT_TYPES[type_name][1] if type_name in GGUF_QUANT_TYPES else None
        return self.tp.size == 1 or (block is not None and module.in_features % block == 0)

    def _kv_rows(self, target: str, shard: int | None) -> slice | None:
        """This rank's rows of a k_proj / v_proj tensor (its KV heads, replicated when there are fewer
        heads than ranks); None for any other tensor."""
        if shard not in (1, 2) or target.split(".")[-2] != "qkv_proj":
            return None
        cfg, d = self.config, self.config.head_dim
        first = self.tp.kv_head_index(cfg.num_key_value_heads)
        return slice(first * d, (first + self.layers[0].self_attn.num_kv_heads) * d)

    def _tensor_parallel_slice_gguf(self, target: str, w: GGUFWeight, shard: int | None = None) -> GGUFWeight:
        """This rank's part of a full checkpoint tensor still in blocks, sharded as the float path does
        (`_tensor_parallel_slice`): output rows, whole blocks of input columns, or vocab rows."""
        tp = self.tp
        if tp.size == 1:
            return w
        sharding = self._SHARDING.get(target.split(".")[-2])
        kv_rows = self._kv_rows(target, shard)
        if kv_rows is not None:
            return w.rows(kv_rows)
        if sharding == "column":
            rows = w.out_features // tp.size
            return w.rows(slice(tp.rank * rows, (tp.rank + 1) * rows))
        if sharding == "row":
            cols = w.in_features // tp.size
            return w.columns(tp.rank * cols, (tp.rank + 1) * cols)
        if sharding == "vocab":
            rows = self.embed_tokens.rows
            return w.rows(slice(tp.rank * rows, (tp.rank + 1) * rows)).padded_rows(rows)
        raise ValueError(f"no tensor-parallel sharding for quantized {target}")

    def _tensor_parallel_slice(self, target: str, tensor: torch.Tensor, shard: int | None = None) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor (Megatron-style sharding)."""
        tp = self.tp
        if tp.size == 1:
            return tensor
        module, kind = target.split(".")[-2:]
        sharding = self._SHARDING.get(module)
        kv_rows = self._kv_rows(target, shard)
        if kv_rows is not None:
            return tensor[kv_rows]
        if sharding == "column":
            return tensor.chunk(tp.size, dim=0)[tp.rank]
        if sharding == "row":
            if kind == "weight":
                return tensor.chunk(tp.size, dim=1)[tp.rank]
            return tensor if tp.rank == 0 else torch.zeros_like(tensor)  # the bias is added once
        if sharding == "vocab":
            rows = self.embed_tokens.rows
            part = tensor[tp.rank * rows : (tp.rank + 1) * rows]
            if part.shape[0] < rows:
                part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
            return part
        return tensor  # norms: replicated

    def _deinterleave_rope(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """DeepSeek rotates adjacent pairs of the rotary dimensions (x0, x1), (x2, x3), ...; the rotary
        kernels here rotate halves (x_i with x_{i + d/2}). Permuting the rows that produce q_pe and
        k_pe to evens then odds makes one the other: the scores are unchanged (q_pe and k_pe are
        only ever dotted with each other), so the cache holds k_pe in the half-split order."""
        cfg = self.config
        if not name.endswith((".q_proj.weight", ".q_b_proj.weight", ".kv_a_proj_with_mqa.weight",
                              ".kv_a_proj_with_mqa.bias")):  # fmt: skip
            return tensor
        rope = cfg.head_dim
        perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        if ".kv_a_proj_with_mqa." in name:  # rows: the latent, then k_pe
            order = torch.cat([torch.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + perm])
        else:  # rows per head: q_nope, then q_pe
            qk = cfg.qk_nope_head_dim + rope
            head = torch.cat([torch.arange(cfg.qk_nope_head_dim), cfg.qk_nope_head_dim + perm])
            rows = tensor.out_features if isinstance(tensor, GGUFWeight) else tensor.shape[0]
            order = (torch.arange(rows // qk)[:, None] * qk + head).reshape(-1)
        if isinstance(tensor, GGUFWeight):  # a GGUF's blocks: whole rows move
            return tensor.rows(order)
        return tensor.index_select(0, order.to(tensor.device))

    def wants(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (HF naming) has a place on this pipeline stage: its layers,
        the embedding and head on stage 0, the rest everywhere. The loader skips the others unread."""
        m = _LAYER_PREFIX.match(name)
        if m is not None:
            return int(m[1]) - self.first_layer in range(len(self.layers))
        if name.removeprefix("model.").startswith(("embed_tokens.", "lm_head.")):
            return self.pp.is_first
        return True

    def _stage_name(self, name: str) -> str | None:
        """A checkpoint name with its layer index made this stage's (None: another stage's tensor)."""
        if self.pp.size == 1:
            return name
        if not self.wants(name):
            return None
        m = _LAYER_PREFIX.match(name)
        if m is None:
            return name
        return f"layers.{int(m[1]) - self.first_layer}.{name[m.end() :]}"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every parameter must be set.
        Under pipeline parallelism, tensors of other stages are skipped."""
        cfg = self.config
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        gguf_parts: dict[str, dict[int, GGUFWeight]] = {}  # module name -> shard -> weight
        attn = self.layers[0].self_attn  # this rank's sizes
        qkv_offsets = [0, attn.q_size, attn.q_size + attn.kv_size] if isinstance(attn, Attention) else []
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            if "rotary_emb" in name:
                continue
            name = self._stage_name(name)
            if name is None:
                continue
            if cfg.rms_norm_offset and name.endswith("norm.weight"):  # Gemma stores w of (1 + w)
                tensor = tensor.float() + cfg.rms_norm_offset
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the sparse block
            name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")  # DeepSeek's
            if cfg.rope_interleave:
                tensor = self._deinterleave_rope(name, tensor)
            expert = _EXPERT_WEIGHT.fullmatch(name)
            if expert is not None:
                loaded.update(self._load_expert_weight(expert, tensor))
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the output projection
            parts = name.split(".")
            target, shard = name, None
            for i, part in enumerate(parts):
                if part in self._FUSED and not (cfg.is_mla and part == "q_proj"):  # MLA's q_proj stands alone
                    fused, shard = self._FUSED[part]
                    target = ".".join(parts[:i] + [fused] + parts[i + 1 :])
                    break
            if isinstance(tensor, GGUFWeight):
                # Checkpoint blocks come from the host: onto the model's device (CUDA: Triton kernels).
                tensor = self._tensor_parallel_slice_gguf(target, tensor, shard).to(self.norm.weight.device)
                gguf_parts.setdefault(target.removesuffix(".weight"), {})[shard or 0] = tensor
                loaded.add(f"{target}#{shard}")
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            tensor = self._tensor_parallel_slice(target, tensor, shard)
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
                    param.copy_(tensor)
                else:
                    fused = target.split(".")[-2]
                    # gate/up: halves of this module's rows (dense, shared-expert MLPs differ in width)
                    start = qkv_offsets[shard] if fused == "qkv_proj" else shard * param.shape[0] // 2
                    param.narrow(0, start, tensor.shape[0]).copy_(tensor)
            loaded.add(f"{target}#{shard}")
        self._set_gguf_weights(gguf_parts)
        expected = {f"{m}.weight#{i if len(parts) > 1 else None}" for m, parts in gguf_parts.items() for i in parts}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                for part in ("gate", "up", "down"):
                    expected.update(f"layers.{i}.mlp.experts.{part}#{e}" for e in range(self.config.num_experts))
        for pname in params:
            if ".mlp.experts." in pname:
                continue  # stacked expert weights: counted per expert above
            fused = pname.split(".")[-2] if "." in pname else ""
            n = self._FUSED_PARTS.get(fused)
            if n is None:
                expected.add(f"{pname}#None")
            else:
                expected.update(f"{pname}#{i}" for i in range(n))
        missing = sorted(expected - loaded)
        unset = [n for n, m in self.named_modules() if getattr(m, "weight", 0) is None and not self._has_gguf(m)]
        if unset:
            raise ValueError(f"checkpoint lacks the quantized weights of {unset[:3]}")
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
