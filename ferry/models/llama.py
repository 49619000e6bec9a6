"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Inputs are one flat batch of tokens (no padding) with their positions and
the attention metadata; K/V go through the paged cache. q/k/v and gate/up
projections are fused into one matmul each (loaded from the separate
checkpoint tensors), which matters on CPUs where small GEMMs are inefficient.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ferry.layers.attention import (
    AttentionMetadata,
    PrefillHost,
    TorchAttentionBackend,
    build_metadata,
    paged_attention,
)
from ferry.layers.int8_linear import Int8Weight, int8_linear, pack_int8_weight
from ferry.layers.linear import Linear, pack_weight, packed_linear
from ferry.layers.rotary import RotaryEmbedding
from ferry.layers.smoothquant import DEFAULT_ALPHA, record_input_absmax, smoothing_factors
from ferry.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Llama's attention_bias covers o_proj too; Qwen2's q/k/v bias does not.
        o_bias = cfg.attention_bias and cfg.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim**-0.5

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
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.max_position = max_position
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._packed_lm_head: torch.Tensor | None = None
        self._int8_lm_head: Int8Weight | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, kv_cache, meta)
        return self.norm(x)

    def init_rotary(self) -> None:
        """(Re)build the fp32 cos/sin tables on the model's device, shared by all layers."""
        cfg = self.config
        device = self.embed_tokens.weight.device
        with torch.device(device):
            rotary = RotaryEmbedding(cfg.head_dim, self.max_position, cfg.rope_theta, cfg.rope_scaling)
        for layer in self.layers:
            layer.self_attn.rotary = rotary

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._int8_lm_head is not None:
            return int8_linear(hidden, self._int8_lm_head, None)
        if self._packed_lm_head is not None:
            return packed_linear(hidden, self._packed_lm_head, None)
        return F.linear(hidden, self._lm_head_weight())

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_linear_weights(self) -> None:
        """Switch every projection (and the output head) to oneDNN-packed fp32 weights (CPU)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self._packed_lm_head, self._int8_lm_head = pack_weight(self._lm_head_weight()), None

    def quantize_linear_weights_int8(self, calibration_ids: list[int], alpha: float = DEFAULT_ALPHA) -> None:
        """Switch every projection and the output head to int8 weights with per-token int8
        activations (CPU, `--quantization int8`), after SmoothQuant smoothing. The output head
        is quantized too: it is the largest matrix of a small model, and llama.cpp's GGUFs keep
        it in Q8_0 for the same trade."""
        head = self.smooth_for_int8(calibration_ids, alpha)
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize_int8()
        self._packed_lm_head, self._int8_lm_head = None, pack_int8_weight(head)

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
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            s = smoothing_factors(absmax[f"{i}.qkv"], attn.qkv_proj.weight, alpha)
            layer.input_layernorm.weight.div_(s)
            attn.qkv_proj.weight.mul_(s)
            s = smoothing_factors(absmax[f"{i}.gate_up"], mlp.gate_up_proj.weight, alpha)
            layer.post_attention_layernorm.weight.div_(s)
            mlp.gate_up_proj.weight.mul_(s)
            # down_proj's input is silu(gate) * up: linear in up, so up's rows take the division.
            s = smoothing_factors(absmax[f"{i}.down"], mlp.down_proj.weight, alpha)
            mlp.gate_up_proj.weight[mlp.intermediate :].div_(s[:, None])
            mlp.down_proj.weight.mul_(s)
        head = self._lm_head_weight()
        s = smoothing_factors(hidden.abs().amax(dim=0), head, alpha)
        self.norm.weight.div_(s)
        return head * s

    @torch.no_grad()
    def _forward_prompt(self, token_ids: list[int]) -> torch.Tensor:
        """Final hidden states [T, hidden] of one prompt, with a throwaway KV cache (calibration)."""
        cfg = self.config
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        T = len(token_ids)
        shape = (T, 1, cfg.num_key_value_heads, cfg.head_dim)  # T blocks of one slot each
        kv = [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in self.layers
        ]
        slots = np.arange(T, dtype=np.int64)
        meta = build_metadata(slot_mapping=slots, block_size=1, decode_blocks=[], decode_seq_lens=slots[:0],
                              prefills=[PrefillHost(0, T, T, slots)], device=device,
                              backend=TorchAttentionBackend(device))  # fmt: skip
        positions = torch.from_numpy(slots).to(device)
        return self(torch.tensor(token_ids, device=device), positions, kv, meta)

    # -- weights --------------------------------------------------------

    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shard_offsets = {"qkv_proj": [0, q, q + kv], "gate_up_proj": [0, cfg.intermediate_size]}
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the output projection
            parts = name.split(".")
            target, shard = name, None
            for i, part in enumerate(parts):
                if part in self._FUSED:
                    fused, shard = self._FUSED[part]
                    target = ".".join(parts[:i] + [fused] + parts[i + 1 :])
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
                    param.copy_(tensor)
                else:
                    fused = target.split(".")[-2]
                    start = shard_offsets[fused][shard]
                    param.narrow(0, start, tensor.shape[0]).copy_(tensor)
            loaded.add(f"{target}#{shard}")
        expected = set()
        for pname in params:
            fused = pname.split(".")[-2] if "." in pname else ""
            n = {"qkv_proj": 3, "gate_up_proj": 2}.get(fused)
            if n is None:
                expected.add(f"{pname}#None")
            else:
                expected.update(f"{pname}#{i}" for i in range(n))
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
