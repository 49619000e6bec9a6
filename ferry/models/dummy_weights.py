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
from collections.abc import Iterator

import torch

from ferry.models.config import ModelConfig

INIT_STD = 0.02


def weight_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor an HF checkpoint of this config holds, with its shape, in checkpoint order."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    o_bias = cfg.attention_bias and cfg.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.append((p + "input_layernorm.weight", (h,)))
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
        shapes += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h))]
        shapes.append((p + "mlp.down_proj.weight", (h, inter)))
    shapes.append(("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        shapes.append(("lm_head.weight", (cfg.vocab_size, h)))
    return shapes


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def iter_dummy_weights(
    cfg: ModelConfig,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, random tensor) for every weight of `cfg`, generated on `device`."""
    device = torch.device(device or "cpu")
    for name, shape in weight_shapes(cfg):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape, dtype=dtype, device=device)
        else:
            gen = torch.Generator(device=device)
            gen.manual_seed(_tensor_seed(seed, name))
            t = torch.empty(shape, dtype=dtype, device=device)
            yield name, t.normal_(0.0, INIT_STD, generator=gen)
