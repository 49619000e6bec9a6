"""`--load-format dummy`: a model's real architecture with random weights, and the configs shipped for it.

The weights come out the way a checkpoint's do (Hugging Face names and shapes, see loader.py), so
the model loads them through the same `load_weights`. They are generated on the device the model
lives on (an 8B model's 16 GB need no host round trip) and are deterministic for a seed and device:
each tensor draws from its own generator, seeded from (seed, name), so the values do not depend on
the order tensors are loaded in. Matrices ~ N(0, 0.02) (HF's `initializer_range`), RMSNorm weights
ones, biases zeros: every activation stays small and the logits finite in bf16 and fp32.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator

import torch

from ferry.layers.gguf_linear import GGUF_QUANT_TYPES, GGUFWeight
from ferry.models.config import O_PROJ_BIAS_ARCHITECTURES, ModelConfig

INIT_STD = 0.02


def weight_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor an HF checkpoint of this config holds, with its shape, in checkpoint order."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    o_bias = cfg.attention_bias and cfg.architecture in O_PROJ_BIAS_ARCHITECTURES
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.append((p + "input_layernorm.weight", (h,)))
        if cfg.is_mla:
            shapes += _mla_shapes(cfg, p + "self_attn.")
        else:
            for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes.append((f"{p}self_attn.{name}.weight", (out, h)))
                if cfg.attention_bias:
                    shapes.append((f"{p}self_attn.{name}.bias", (out,)))
            shapes.append((p + "self_attn.o_proj.weight", (h, q)))
            if o_bias:
                shapes.append((p + "self_attn.o_proj.bias", (h,)))
            if cfg.qk_norm:
                shapes += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        shapes.append((p + "post_attention_layernorm.weight", (h,)))
        if cfg.sandwich_norms:
            shapes += [(p + "pre_feedforward_layernorm.weight", (h,)), (p + "post_feedforward_layernorm.weight", (h,))]
        if i in cfg.moe_layers:
            shapes += _moe_shapes(cfg, p + "mlp.")
        else:
            shapes += _mlp_shapes(p + "mlp.", h, inter)
    shapes.append(("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        shapes.append(("lm_head.weight", (cfg.vocab_size, h)))
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (prefix + "gate_proj.weight", (inter, hidden)),
        (prefix + "up_proj.weight", (inter, hidden)),
        (prefix + "down_proj.weight", (hidden, inter)),
    ]


def _mla_shapes(cfg: ModelConfig, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """Multi-head latent attention's tensors (DeepSeek-V2/V3 names)."""
    h, heads, qk = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.head_dim
    if cfg.q_lora_rank:
        shapes = [
            (prefix + "q_a_proj.weight", (cfg.q_lora_rank, h)),
            (prefix + "q_a_layernorm.weight", (cfg.q_lora_rank,)),
            (prefix + "q_b_proj.weight", (heads * qk, cfg.q_lora_rank)),
        ]
    else:
        shapes = [(prefix + "q_proj.weight", (heads * qk, h))]
    return shapes + [
        (prefix + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.head_dim, h)),
        (prefix + "kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
        (prefix + "kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)),
        (prefix + "o_proj.weight", (h, heads * cfg.v_head_dim)),
    ]


def _moe_shapes(cfg: ModelConfig, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """A sparse block's tensors under Qwen-MoE's names (the loader reads Mixtral's and DeepSeek's too)."""
    h = cfg.hidden_size
    shapes = [(prefix + "gate.weight", (cfg.num_experts, h))]
    if cfg.moe_score_bias:
        shapes.append((prefix + "gate.e_score_correction_bias", (cfg.num_experts,)))
    for e in range(cfg.num_experts):
        shapes += _mlp_shapes(f"{prefix}experts.{e}.", h, cfg.moe_intermediate_size)
    if cfg.shared_expert_intermediate_size:
        shapes += _mlp_shapes(prefix + "shared_expert.", h, cfg.shared_expert_intermediate_size)
        if cfg.shared_expert_gated:
            shapes.append((prefix + "shared_expert_gate.weight", (1, h)))
    return shapes


def write_config_dir(directory: str, config: dict) -> str:
    """Make `directory` a model for `--load-format dummy`: a config.json and nothing else."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


# `--load-format dummy --quantization gguf`: the projections come as random blocks of this type, the
# embedding and the head stay float, as in a GPTQ int4 checkpoint (symmetric 4-bit: Q4_0 at load).
DUMMY_GGUF_TYPE = "Q4_0"


def quantizable_weights(cfg: ModelConfig) -> dict[str, str]:
    """HF name -> DUMMY_GGUF_TYPE of every projection weight (not the embedding or the head)."""
    return {
        name: DUMMY_GGUF_TYPE
        for name, shape in weight_shapes(cfg)
        if len(shape) == 2 and name.startswith("model.layers.") and shape[1] % 32 == 0
    }


def dummy_q4_0(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> GGUFWeight:
    """Random Q4_0 blocks in the kernels' layout: nibbles uniform in 1..15, so that q - 8 is centred
    (uniform 0..15 gave every weight a -0.5-step bias, which pulled all tokens' hidden states the same
    way and made a MoE router pick the same few experts for every token), std ~4.3, with every scale
    INIT_STD / 4.3: the float dummies' spread."""
    n, k = shape
    low = torch.randint(1, 16, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    high = torch.randint(1, 16, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    quants = low | (high << 4)
    scales = torch.full((n, k // 32), INIT_STD / 4.3, dtype=torch.float16, device=device).view(torch.uint8)
    tid = GGUF_QUANT_TYPES[DUMMY_GGUF_TYPE][0]
    return GGUFWeight(torch.cat([quants, scales], dim=1), tid, k)


def iter_dummy_weights(
    cfg: ModelConfig,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    keep_quantized: frozenset[str] = frozenset(),
    wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """Yield (HF name, random tensor) for every weight of `cfg` that `wanted` accepts (all when None),
    generated on `device`; those named in `keep_quantized` (from quantizable_weights) as random Q4_0
    blocks instead."""
    device = torch.device(device or "cpu")
    for name, shape in weight_shapes(cfg):
        if wanted is not None and not wanted(name):
            continue
        if name.endswith("norm.weight"):  # a scale of one (Gemma's checkpoints store it less one)
            yield name, torch.full(shape, 1.0 - cfg.rms_norm_offset, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape, dtype=dtype, device=device)
        else:
            gen = torch.Generator(device=device)
            gen.manual_seed(_tensor_seed(seed, name))
            if name in keep_quantized:
                yield name, dummy_q4_0(shape, gen, device)
                continue
            t = torch.empty(shape, dtype=dtype, device=device)
            yield name, t.normal_(0.0, INIT_STD, generator=gen)
