"""A whole decode step in one C++ call, for a Llama-family model whose projections all run as GGUF
blocks on the CPU (ferry/kernels/csrc/decode_step_cpu.cpp).

At batch 1 the layer-by-layer forward spent more time in Python, pybind crossings, allocations
and thread forks (30 layers x a dozen ops) than in reading the weights. The C++ step loops over
the layers itself, on buffers allocated once per step, calling the very kernels the Python path
calls: both compute the same numbers (tests/models/test_cpu_decode_step.py). It takes steps
made only of decode rows whose attention is the C++ paged decode kernel (fp32, bf16, int8 or fp8
cache); any other step (prompt rows, another backend) runs the Python forward. Mixture-of-experts
layers with softmax routing (Mixtral, Qwen2-MoE, Qwen3-MoE) run in it too, their experts as GGUF
blocks; DeepSeek's grouped routing comes with MLA, which it does not take. So do sliding-window
layers (Mistral, Qwen2's local/global mix), through the torch backend's window views.

`--enforce-eager` keeps every step on the Python path (vLLM's flag for "no compiled or captured
step").
"""

from __future__ import annotations

import logging

import torch

from ferry.kernels.cpu import cpu_kernels
from ferry.layers.attention import AttentionMetadata
from ferry.layers.attention.torch_backend import TorchAttentionBackend
from ferry.models.llama import SparseMoeBlock

logger = logging.getLogger(__name__)

_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)


def _parts(linear) -> list[tuple[torch.Tensor, int]]:
    return [(w.data, w.qtype) for w in linear.gguf]


class CPUDecodeStep:
    """Built once from a loaded model (`build`); `runs` says whether it takes a step."""

    def __init__(self, model, step) -> None:
        self._embed = model.embed_tokens
        self._step = step  # the C++ DecodeStep, holding references to the model's tensors
        windows = [layer.self_attn.window for layer in model.layers]
        self._views = sorted({w for w in windows if w is not None})  # the distinct windows
        # each layer's view (-1: the whole context), fixed for the model: not recomputed per step
        self._layer_view = [-1 if w is None else self._views.index(w) for w in windows] if self._views else []
        # builds (and caches in the step's metadata) the windows' decode tables, as the Python path does
        self._backend = TorchAttentionBackend(torch.device("cpu"), use_cpu_kernel=True)

    @classmethod
    def build(cls, model) -> CPUDecodeStep | None:
        """The C++ step for `model`, or None (with the reason logged) when it cannot take it."""
        why = cls._unsupported(model)
        if why:
            logger.info("decode steps run layer by layer in Python: %s", why)
            return None
        cfg, attn = model.config, model.layers[0].self_attn
        dense = [layer.mlp for layer in model.layers if not isinstance(layer.mlp, SparseMoeBlock)]
        step = cpu_kernels().DecodeStep(
            cfg.hidden_size, dense[0].intermediate if dense else 0, attn.num_heads, attn.num_kv_heads,
            attn.head_dim, cfg.rms_norm_eps, attn.scale, attn.rotary.cos, attn.rotary.sin, model.norm.weight.detach(),
        )  # fmt: skip
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            attention = (
                layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                _parts(a.qkv_proj), _detached(a.qkv_proj.bias),
                _detached(a.q_norm.weight if a.q_norm is not None else None),
                _detached(a.k_norm.weight if a.k_norm is not None else None),
                _parts(a.o_proj), _detached(a.o_proj.bias),
            )  # fmt: skip
            if not isinstance(mlp, SparseMoeBlock):
                step.add_layer(*attention, _parts(mlp.gate_up_proj), _parts(mlp.down_proj))
                continue
            experts, shared = mlp.experts, mlp.shared_expert
            step.add_moe_layer(
                *attention, mlp.gate.weight.detach(), mlp.top_k, mlp.renormalize, cfg.routed_scaling_factor,
                experts.intermediate, [[(w.data, w.qtype) for w in parts] for parts in experts.gguf13],
                [[(w.data, w.qtype)] for w in experts.gguf2],
                _parts(shared.gate_up_proj) if shared is not None else [],
                _parts(shared.down_proj) if shared is not None else [],
                _detached(mlp.shared_expert_gate.weight if mlp.shared_expert_gate is not None else None),
            )  # fmt: skip
        return cls(model, step)

    @staticmethod
    def _unsupported(model) -> str | None:
        if getattr(model, "quantization", None) != "gguf":
            return "the C++ decode step runs GGUF-quantized weights only"
        if model.tp.size > 1:
            return "tensor parallelism"
        if any(getattr(layer.self_attn, "softcap", None) is not None for layer in model.layers):
            return "soft-capped attention scores"
        if model.config.sandwich_norms or model.config.hidden_act != "silu" or model.config.embed_scale != 1.0:
            return "Gemma's norms, GeGLU and scaled embedding"
        if model.config.is_mla:
            return "multi-head latent attention"
        cfg = model.config
        if cfg.moe_layers and (cfg.moe_scoring != "softmax" or cfg.moe_n_group > 1 or cfg.moe_score_bias):
            return "DeepSeek's grouped or sigmoid expert routing"
        if cpu_kernels() is None or not hasattr(cpu_kernels(), "DecodeStep"):
            return "ferry's CPU kernels are unavailable"
        linears, experts = [], []
        for layer in model.layers:
            mlp = layer.mlp
            linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            if not isinstance(mlp, SparseMoeBlock):
                linears += [mlp.gate_up_proj, mlp.down_proj]
                continue
            if mlp.experts.gguf13 is None:
                return "some experts are not GGUF-quantized"
            experts += [w for parts in mlp.experts.gguf13 for w in parts] + list(mlp.experts.gguf2)
            if mlp.shared_expert is not None:
                linears += [mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj]
        if any(m.gguf is None for m in linears):
            return "some projections are not GGUF-quantized"
        if any(w.input_order is not None for w in experts + [w for m in linears for w in m.gguf]):
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
            and not (self._views and meta.decode_tree is not None)  # (no window with a draft tree)
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        pre_norm: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final norm's output [B, hidden] for B decode tokens (the LM head's input). `hidden`:
        the residual stream entering the first layer, instead of the tokens' embeddings (early
        exit's verification). `pre_norm`: also the residual stream before the final norm."""
        x = self._embed(input_ids) if hidden is None else hidden.contiguous()
        views = [self._backend.view(meta, w) for w in self._views]
        stream = torch.empty_like(x) if pre_norm else None
        out = self._step.forward(
            x, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens,
            [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.decode_tree,
            self._layer_view,
            [v.decode_tables for v in views], [v.decode_lens for v in views], [v.decode_skip for v in views],
            stream,
        )  # fmt: skip
        return (out, stream) if pre_norm else out


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()
