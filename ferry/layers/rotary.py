"""Rotary position embeddings (NeoX / Hugging Face half-split layout) with the config's scaling.

Supported `rope_type`s: default, linear, dynamic (NTK, applied for the
maximum length up front), llama3, yarn. Frequencies follow transformers'
`ROPE_INIT_FUNCTIONS`, which the tests compare against.
"""

from __future__ import annotations

import math

import torch

from ferry.kernels.cpu import cpu_kernels


def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def attention_scale(head_dim: int, scaling: dict | None) -> float:
    """Softmax scale for q.k of width `head_dim`: 1/sqrt(head_dim), times YaRN's mscale squared where
    the config names `mscale_all_dim` (DeepSeek: the temperature goes into the scores, not cos/sin)."""
    scale = head_dim**-0.5
    if scaling and scaling.get("rope_type") not in (None, "default") and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2
    return scale


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None, max_position: int,
                  trained_len: int | None = None) -> tuple[torch.Tensor, float]:  # fmt: skip
    """Return (inverse frequencies [head_dim/2], attention scaling for cos/sin). `max_position`: the
    longest sequence served; `trained_len`: the model's max_position_embeddings, the length dynamic
    and YaRN scaling stretch from where the config names no original_max_position_embeddings (as
    transformers reads it; default: `max_position`)."""
    trained_len = trained_len or max_position
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
    inv_freq = _default_inv_freq(head_dim, base)
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "dynamic":
        # NTK-aware base for the longest sequence this engine will serve.
        orig = scaling.get("original_max_position_embeddings", trained_len)
        seq = max(max_position, orig)
        new_base = base * ((factor * seq / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return _default_inv_freq(head_dim, new_base), 1.0
    if rope_type == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        orig = scaling.get("original_max_position_embeddings", trained_len)
        beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
        mscale = scaling.get("attention_factor")
        if mscale is None:
            # DeepSeek's configs name both: their ratio scales cos/sin (1 when equal, as in V2-Lite's).
            if scaling.get("mscale") and scaling.get("mscale_all_dim"):
                mscale = yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
            else:
                mscale = yarn_mscale(factor)

        def correction_dim(rot: float) -> float:
            return (head_dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv, float(mscale)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None,
                 trained_len: int | None = None) -> None:  # fmt: skip
        super().__init__()
        if torch.empty(0).device.type == "meta":
            # The loader's meta-device model: init_rotary() builds the real tables once the model has a
            # device. Computing them on meta fills nothing, yet torch's meta path imports torch._dynamo
            # (~1.5 s of every server's start).
            self.register_buffer("cos", torch.empty(max_position, head_dim // 2), persistent=False)
            self.register_buffer("sin", torch.empty(max_position, head_dim // 2), persistent=False)
            return
        inv_freq, attn_scale = rope_inv_freq(head_dim, base, scaling, max_position, trained_len)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos() * attn_scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * attn_scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D], positions: [T]. On CUDA one Triton kernel rotates q and
        k in place (fp32 math); elsewhere torch computes in q's dtype, like transformers."""
        if q.is_cuda:
            from ferry.kernels.triton_fused import rotary_

            rotary_(positions, q, k, self.cos, self.sin)
            return q, k
        if q.dtype == torch.float32 and k.dtype == torch.float32 and q.stride(-1) == 1 and k.stride(-1) == 1:
            kernels = cpu_kernels()
            if kernels is not None:  # one C++ pass, in place (q/k may be views into the fused qkv)
                kernels.rotary_(positions, q, k, self.cos, self.sin)
                return q, k
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(q.dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
