"""The model description the engine needs, parsed from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

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

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
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
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = (rope or {}).get("rope_theta", 10000.0)

        sliding_window = d.get("sliding_window")
        # Qwen2/Qwen3 configs carry a sliding_window value even when it is switched off.
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not d.get("use_sliding_window", False):
            sliding_window = None

        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=normalize_rope_scaling(rope),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its config leaves attention_bias unset.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids(d.get("eos_token_id")),
            dtype=d.get("dtype") or d.get("torch_dtype") or "float32",
        )
