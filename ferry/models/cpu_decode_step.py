"""A whole decode step in one C++ call, for a Llama-family model whose projections all run as GGUF
blocks on the CPU (ferry/kernels/csrc/decode_step_cpu.cpp).

At batch 1 the layer-by-layer forward spent more time in Python, pybind crossings, allocations
and thread forks (30 layers x a dozen ops) than in reading the weights. The C++ step loops over
the layers itself, on buffers allocated once per step, calling the very kernels the Python path
calls: both compute the same numbers (tests/models/test_cpu_decode_step.py). It takes steps
made only of decode rows whose attention is the C++ paged decode kernel (fp32, bf16, int8 or fp8
cache); any other step (prompt rows, another backend) runs the Python forward.

`--enforce-eager` keeps every step on the Python path (vLLM's flag for "no compiled or captured
step").
"""

from __future__ import annotations

import logging

import torch

from ferry.kernels.cpu import cpu_kernels
from ferry.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)


def _parts(linear) -> list[tuple[torch.Tensor, int]]:
    return [(w.data, w.qtype) for w in linear.gguf]


class CPUDecodeStep:
    """Built once from a loaded model (`build`); `runs` says whether it takes a step."""

    def __init__(self, model, step) -> None:
        self._embed = model.embed_tokens
        self._step = step  # the C++ DecodeStep, holding references to the model's tensors

    @classmethod
    def build(cls, model) -> CPUDecodeStep | None:
        """The C++ step for `model`, or None (with the reason logged) when it cannot take it."""
        why = cls._unsupported(model)
        if why:
            logger.info("decode steps run layer by layer in Python: %s", why)
            return None
        cfg, first = model.config, model.layers[0]
        attn = first.self_attn
        step = cpu_kernels().DecodeStep(
            cfg.hidden_size, first.mlp.intermediate, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            cfg.rms_norm_eps, attn.scale, attn.rotary.cos, attn.rotary.sin, model.norm.weight.detach(),
        )  # fmt: skip
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            step.add_layer(
                layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                _parts(a.qkv_proj), _detached(a.qkv_proj.bias),
                _detached(a.q_norm.weight if a.q_norm is not None else None),
                _detached(a.k_norm.weight if a.k_norm is not None else None),
                _parts(a.o_proj), _detached(a.o_proj.bias), _parts(mlp.gate_up_proj), _parts(mlp.down_proj),
            )  # fmt: skip
        return cls(model, step)

    @staticmethod
    def _unsupported(model) -> str | None:
        if getattr(model, "quantization", None) != "gguf":
            return "the C++ decode step runs GGUF-quantized weights only"
        if model.tp.size > 1:
            return "tensor parallelism"
        if model.config.sliding_window is not None:
            return "sliding-window attention (its C++ attention reads whole contexts)"
        if model.config.sandwich_norms or model.config.hidden_act != "silu" or model.config.embed_scale != 1.0:
            return "Gemma's norms, GeGLU and scaled embedding"
        if model.config.moe_layers:
            return "mixture-of-experts layers run their experts grouped in Python"
        if model.config.is_mla:
            return "multi-head latent attention"
        if cpu_kernels() is None or not hasattr(cpu_kernels(), "DecodeStep"):
            return "ferry's CPU kernels are unavailable"
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj)]  # fmt: skip
        if any(m.gguf is None for m in linears):
            return "some projections are not GGUF-quantized"
        if any(w.input_order is not None for m in linears for w in m.gguf):
            return "activation-order (GPTQ desc_act) weights gather their inputs in Python"
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
            return "the model is not float32 on the CPU"
        return None

    def runs(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> bool:
        """Whether this step is one the C++ path takes: decode rows only, through the C++ attention."""
        state = meta.state
        return (
            meta.num_prefills == 0
            and meta.num_decodes > 0
            and getattr(state, "use_cpu_kernel", False)
            and kv_caches[0][0].dtype in _CACHE_DTYPES
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final norm's output [B, hidden] for B decode tokens (the LM head's input)."""
        x = self._embed(input_ids)
        return self._step.forward(
            x, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens,
            [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.decode_tree,
        )  # fmt: skip


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()
