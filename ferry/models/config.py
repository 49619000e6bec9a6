"""The model description the engine needs, parsed from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    # Mixtures of experts: the same decoder with a sparse MLP block (layers/moe.py).
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    # Multi-head latent attention (layers/mla.py) with DeepSeek's routed + shared experts.
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    # Local (sliding-window) and global layers, GeGLU, sandwich norms (and Gemma 2's soft-capping).
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Where attention_bias puts a bias on o_proj as well as on q/k/v (Qwen2's covers q/k/v only).
O_PROJ_BIAS_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", *_GEMMA)
# HF's names of the gate activations the MLP runs (layers/fused.py).
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

# config.json keys without a sensible default.
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def normalize_rope_scaling(rope: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return HF's rope scaling dict with a `rope_type` key, or None for plain RoPE.

    Older configs spell the key `type`; transformers 5 folds `rope_theta` into the same dict
    (`rope_parameters`), which is not a scaling parameter, so it is dropped here.
    """
    if not rope:
        return None
    out = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    out["rope_type"] = rope_type
    return out


def check_architecture(arch: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; ferry supports {', '.join(SUPPORTED_ARCHITECTURES)}")


def eos_ids(value: int | list[int] | None) -> list[int]:
    """HF configs hold `eos_token_id` as an int, a list of ints, or null."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass
class ModelConfig:
    """What the engine needs to build and run a decoder; field names follow HF's config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Biases on q/k/v; Llama/Mistral's attention_bias also puts one on o_proj (Qwen2's does not).
    attention_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    dtype: str
    # Mixture of experts (num_experts 0: a dense model). The layers in moe_layers replace the MLP by
    # num_experts routed experts of moe_intermediate_size, num_experts_per_tok per token, their
    # softmax weights renormalised over the chosen ones when norm_topk_prob; Qwen2-MoE adds one
    # sigmoid-gated shared expert of shared_expert_intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    # Layers that attend to the whole context although the model has a sliding_window (Qwen2/Qwen3
    # window only the layers from max_window_layers on, Gemma every other or every sixth layer is
    # global): a local/global mix, whose blocks are kept for the global layers (`layer_window`).
    full_attention_layers: tuple[int, ...] = ()
    # DeepSeek's routing (layers/moe.py `select_experts`): softmax or sigmoid scores, the top k taken
    # within the topk_group best of n_group expert groups (V3 adds a per-expert score bias for the
    # choice only), weights times routed_scaling_factor. Its shared experts are ungated.
    moe_scoring: str = "softmax"
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_group_score: str = "max"  # a group's score: its best expert (V2), or its best two summed (V3)
    moe_score_bias: bool = False
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True
    # Multi-head latent attention (kv_lora_rank > 0): the cache holds one compressed latent of
    # kv_lora_rank plus a shared rotary key of qk_rope_head_dim per token (head_dim is that rotary
    # width); queries go through a q_lora_rank bottleneck unless it is 0. rope_interleave: the rotary
    # pairs are adjacent dimensions (DeepSeek's layout).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # Gemma 2/3. hidden_act: the MLP's gate activation (silu, or gelu_tanh for GeGLU). rms_norm_offset:
    # RMSNorm scales by (offset + w) (Gemma's checkpoints store w around 0; the loader adds the 1).
    # sandwich_norms: each sublayer's output is normed before the residual add (post_attention_layernorm,
    # post_feedforward_layernorm) and the MLP's input by pre_feedforward_layernorm. embed_scale: the
    # embedding's rows times sqrt(hidden). query_pre_attn_scalar: softmax scale its -1/2 power (else
    # head_dim's). attn/final_logit_softcapping: cap * tanh(x / cap) on the attention scores / the
    # logits (Gemma 2). local_rope_theta: Gemma 3's sliding layers' own rotary base, unscaled.
    hidden_act: str = "silu"
    rms_norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None

    @property
    def context_length(self) -> int:
        """The longest sequence the checkpoint is meant for (vLLM's derived max_model_len, the default
        one): max_position_embeddings, stretched by the RoPE scaling factor where the scaling names
        the trained length (linear, dynamic; yarn from its original length). llama3 and longrope
        configs, and Gemma 3's, state the stretched length already."""
        rope = self.rope_scaling
        if (
            rope is None
            or rope["rope_type"] in ("llama3", "longrope", "su")
            or self.architecture == "Gemma3ForCausalLM"
        ):
            return self.max_position_embeddings
        trained = self.max_position_embeddings
        if rope["rope_type"] == "yarn":
            trained = rope.get("original_max_position_embeddings") or trained
        return int(trained * float(rope.get("factor", 1.0)))

    def check_max_model_len(self, max_model_len: int | None, env: Mapping[str, str] = os.environ) -> None:
        """ValueError for a --max-model-len past `context_length` (positions the model never saw: wrong
        outputs, not an error), unless FERRY_ALLOW_LONG_MAX_MODEL_LEN or vLLM's
        VLLM_ALLOW_LONG_MAX_MODEL_LEN is 1 or true, as vLLM checks."""
        if max_model_len is None or max_model_len <= self.context_length:
            return
        why = (f"max_model_len {max_model_len} is longer than the model's context, {self.context_length} tokens "
               f"(max_position_embeddings {self.max_position_embeddings} and its RoPE scaling): the positions "
               "past it were never trained, and outputs there are wrong")  # fmt: skip
        allow = env.get("FERRY_ALLOW_LONG_MAX_MODEL_LEN") or env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") or "0"
        if allow.strip().lower() in ("1", "true"):
            logger.warning("%s (allowed by FERRY_ALLOW_LONG_MAX_MODEL_LEN)", why)
            return
        raise ValueError(f"{why}; lower max_model_len, or set FERRY_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: it attends to the whole context)."""
        if self.sliding_window is None or i in self.full_attention_layers:
            return None
        return self.sliding_window

    @property
    def kv_cache_width(self) -> int:
        """Values per cached row: a head's K (and V) of head_dim, or MLA's latent and rotary key."""
        return self.kv_lora_rank + self.head_dim if self.is_mla else self.head_dim

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        self.moe_layers = tuple(self.moe_layers)
        if self.moe_layers:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts ({self.num_experts})]"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
            if not all(0 <= i < self.num_hidden_layers for i in self.moe_layers):
                raise ValueError(f"moe_layers {self.moe_layers} name layers outside [0, {self.num_hidden_layers})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config.json dict (transformers 4 or 5 layout)."""
        archs = d.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
        arch = archs[0]
        # Checked before reading fields: other architectures may lack the keys read below.
        check_architecture(arch)
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ValueError(f"config.json for {arch} is missing {', '.join(missing)}")
        if d.get("mlp_bias"):
            # ModelConfig has no field for it, so the model would silently drop the MLP biases.
            raise ValueError(f"{arch} with mlp_bias=true is not supported")

        heads = d["num_attention_heads"]
        # transformers 5 writes `rope_parameters` (theta included); 4.x writes rope_theta + rope_scaling.
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        local_rope = None
        if arch == "Gemma3ForCausalLM":
            if rope and "full_attention" in rope:  # transformers 5: one dict per layer type
                local_rope, rope = rope.get("sliding_attention"), rope["full_attention"]
            else:  # transformers 4: the local layers' base apart
                local_rope = {"rope_theta": d.get("rope_local_base_freq", 10000.0)}
            if normalize_rope_scaling(local_rope) is not None:
                raise ValueError(f"{arch}: scaled rotary on the sliding layers is not supported")
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = (rope or {}).get("rope_theta", 10000.0)

        sliding_window = d.get("sliding_window")
        # Qwen configs carry a sliding_window value even when it is switched off.
        if arch.startswith("Qwen") and not d.get("use_sliding_window", False):
            sliding_window = None
        full_layers: tuple[int, ...] = ()
        if sliding_window is not None and arch.startswith(("Qwen", "Gemma")):  # Mistral windows every layer
            layers = range(d["num_hidden_layers"])
            types = d.get("layer_types")
            if types:
                full_layers = tuple(i for i in layers if types[i] != "sliding_attention")
            elif arch == "Gemma2ForCausalLM":  # HF's rule: every other layer global, from layer 1
                full_layers = tuple(i for i in layers if (i + 1) % 2 == 0)
            elif arch == "Gemma3ForCausalLM":  # every sliding_window_pattern-th layer global
                pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
                full_layers = tuple(i for i in layers if (i + 1) % pattern == 0)
            else:  # HF's rule: the window from layer max_window_layers on
                full_layers = tuple(i for i in layers if i < d.get("max_window_layers", 28))
            if len(full_layers) == d["num_hidden_layers"]:
                sliding_window, full_layers = None, ()

        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            # MLA has no KV heads of its own (its one latent row serves every head).
            num_key_value_heads=heads if arch in _DEEPSEEK else d.get("num_key_value_heads") or heads,
            # MLA: the rotary key's width (the one per-head size of the cache that is a head's)
            head_dim=d["qk_rope_head_dim"] if arch in _DEEPSEEK else d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=normalize_rope_scaling(rope),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch in _GEMMA)),  # Gemma ties by default
            # Qwen2 always has q/k/v biases; its config leaves attention_bias unset. Qwen2-MoE says qkv_bias.
            attention_bias=(
                arch == "Qwen2ForCausalLM"
                or (arch == "Qwen2MoeForCausalLM" and d.get("qkv_bias", True))
                or bool(d.get("attention_bias", False))
            ),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=sliding_window,
            full_attention_layers=full_layers,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids(d.get("eos_token_id")),
            dtype=d.get("dtype") or d.get("torch_dtype") or "float32",
            **_moe_fields(arch, d),
            **_mla_fields(arch, d),
            **_gemma_fields(arch, d, local_rope),
        )


def _moe_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from an HF config.json (none for a dense architecture)."""
    if arch == "MixtralForCausalLM":  # every layer sparse; experts as wide as the dense MLP; always renormalised
        return dict(
            num_experts=d.get("num_local_experts", 8),
            num_experts_per_tok=d.get("num_experts_per_tok", 2),
            moe_intermediate_size=d["intermediate_size"],
            norm_topk_prob=True,
            moe_layers=tuple(range(d["num_hidden_layers"])),
        )
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        # transformers 5 writes num_local_experts where Qwen's own configs say num_experts.
        experts = d.get("num_experts") or d.get("num_local_experts") or 0
        step, dense = d.get("decoder_sparse_step", 1) or 1, set(d.get("mlp_only_layers") or ())
        layers = range(d["num_hidden_layers"])
        shared = d.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
        return dict(
            num_experts=experts,
            num_experts_per_tok=d.get("num_experts_per_tok", 0),
            moe_intermediate_size=d.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=shared or 0,
            moe_layers=tuple(i for i in layers if experts > 0 and i not in dense and (i + 1) % step == 0),
        )
    if arch in _DEEPSEEK:
        experts = d.get("n_routed_experts") or 0
        first_dense, freq = d.get("first_k_dense_replace", 0) or 0, d.get("moe_layer_freq", 1) or 1
        v3 = arch == "DeepseekV3ForCausalLM"
        method = d.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"{arch}: unsupported topk_method {method!r}")
        grouped = method != "greedy"
        scoring = d.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"{arch}: unsupported scoring_func {scoring!r}")
        return dict(
            num_experts=experts,
            num_experts_per_tok=d.get("num_experts_per_tok") or 0,
            moe_intermediate_size=d.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=(d.get("n_shared_experts") or 0) * d.get("moe_intermediate_size", 0),
            shared_expert_gated=False,
            moe_layers=tuple(
                i for i in range(d["num_hidden_layers"]) if experts > 0 and i >= first_dense and i % freq == 0
            ),
            moe_scoring=scoring,
            moe_n_group=(d.get("n_group") or 1) if grouped else 1,
            moe_topk_group=(d.get("topk_group") or 1) if grouped else 1,
            moe_group_score="top2_sum" if method == "noaux_tc" else "max",
            moe_score_bias=method == "noaux_tc",
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0) or 1.0),
        )
    return {}


def _gemma_fields(arch: str, d: dict[str, Any], local_rope: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 2/3's fields: GeGLU, (1 + w) norms around each sublayer, the scaled embedding, the
    softmax scale from query_pre_attn_scalar, soft-capping (Gemma 2), the local layers' rotary base
    (Gemma 3)."""
    if arch not in _GEMMA:
        return {}
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"{arch}: unsupported hidden_activation {act!r}")
    return dict(
        hidden_act=_ACTIVATIONS[act],
        rms_norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=float(d["hidden_size"]) ** 0.5,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or d.get("head_dim") or 256),
        attn_logit_softcapping=d.get("attn_logit_softcapping"),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        local_rope_theta=float(local_rope["rope_theta"]) if local_rope else None,
    )


def _mla_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention's fields (DeepSeek-V2/V3)."""
    if arch not in _DEEPSEEK:
        return {}
    return dict(
        kv_lora_rank=d["kv_lora_rank"],
        q_lora_rank=d.get("q_lora_rank") or 0,
        qk_nope_head_dim=d["qk_nope_head_dim"],
        v_head_dim=d["v_head_dim"],
        # DeepSeek-V2's rotary always pairs adjacent dimensions; V3 says so in rope_interleave.
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(d.get("rope_interleave", True)),
    )
