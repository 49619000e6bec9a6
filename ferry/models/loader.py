"""Find a checkpoint (GGUF file or Hugging Face directory), read its config, and stream its weights.

Whatever the format, weights come out with Hugging Face Llama/Qwen names and shapes
([out_features, in_features]), so the model code deals with one layout only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ferry.layers.gguf_linear import GGUF_QUANT_TYPES, GGUFWeight
from ferry.models.config import ModelConfig
from ferry.models.dummy_weights import iter_dummy_weights, quantizable_weights
from ferry.models.gguf_file import GGUFFile
from ferry.models.paths import resolve_model_path, safetensors_files
from ferry.models.quantized_checkpoints import (
    HFQuantization,
    parse_quantization_config,
    quantized_modules,
    unpack_module,
)
from ferry.models.shard_reader import read_ahead, slice_bytes

logger = logging.getLogger(__name__)

# GGUF architecture -> HF class. llama.cpp also files Mistral under "llama" (see _gguf_architecture).
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Mixtral too, when it has experts
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",  # V3 too, when its router has the score-correction bias
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_GGUF_GEMMA = ("gemma2", "gemma3")
# Gemma's sandwich norms: llama.cpp's ffn_norm is the MLP's input norm there (Llama's
# post_attention_layernorm), post_attention_norm the attention output's, post_ffw_norm the MLP output's.
_GGUF_GEMMA_NORMS = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Whether llama.cpp renormalises the chosen experts' weights, where the GGUF does not say
# ({arch}.expert_weights_norm): its graphs hard-code it per architecture.
_GGUF_NORM_TOPK = {"MixtralForCausalLM": True, "Qwen2MoeForCausalLM": False, "Qwen3MoeForCausalLM": True}

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture-of-experts blocks: the router, every expert stacked [E, ...], the shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # DeepSeek (deepseek2): multi-head latent attention, and V3's router bias. llama.cpp's newer files
    # split kv_b into attn_k_b (per head, transposed) and attn_v_b; the reader joins them back.
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "exp_probs_b": "mlp.gate",
}

# GGUF rope.scaling.* metadata -> keys of HF's rope_scaling dict.
_GGUF_ROPE_SCALING_KEYS = {
    "original_context_length": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "attn_factor": "attention_factor",
}

_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class Checkpoint:
    path: str
    config: ModelConfig
    format: str  # "gguf" | "safetensors" | "dummy" (random weights, nothing read)
    seed: int = 0  # of the dummy weights
    # The parsed GGUF header (~1.5 s to parse for a 49k-token vocabulary), kept so that
    # iter_weights does not parse it again.
    _gguf_reader: Any = field(default=None, repr=False, compare=False)
    _quantized: dict[str, str] | None = field(default=None, repr=False, compare=False)
    # A GPTQ / AWQ / compressed-tensors checkpoint: its parsed quantization_config, and its quantized
    # modules (checkpoint module name -> the names of the tensors that make up its weight).
    hf_quantization: HFQuantization | None = None
    hf_quantized_modules: dict[str, list[str]] = field(default_factory=dict, repr=False)

    def iter_weights(
        self,
        device: torch.device | str | None = None,
        keep_quantized: frozenset[str] = frozenset(),
        wanted: Callable[[str], bool] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
        """Yield (HF name, tensor) one at a time, so that peak memory stays near one tensor.

        Checkpoint tensors come from the host; dummy ones are generated on `device` (default CPU).
        GGUF tensors named in `keep_quantized` come as `GGUFWeight`s, still in their block format;
        every other quantized tensor is dequantized to fp32. A GPTQ/AWQ/compressed-tensors module
        comes as one `<module>.weight`: blocks for the GGUF kernels if named in `keep_quantized`,
        else its fp32 dequantization. Tensors `wanted` refuses (another pipeline stage's) are skipped
        before they are read.
        """
        wanted = wanted or (lambda name: True)
        if self.format == "dummy":
            yield from iter_dummy_weights(self.config, self.seed, device, keep_quantized=keep_quantized, wanted=wanted)
        elif self.format == "gguf":
            yield from self._iter_gguf(keep_quantized, wanted)
        else:
            yield from self._iter_safetensors(keep_quantized, wanted)

    def quantized_tensors(self) -> dict[str, str]:
        """HF weight name -> storage type of every weight stored quantized in a form the GGUF kernels
        can run: a GGUF's quantized tensors, or the modules of a GPTQ/AWQ/compressed-tensors checkpoint."""
        if self.hf_quantization is not None:
            return {f"{m}.weight": self.hf_quantization.method for m in self.hf_quantized_modules}
        if self.format == "dummy":  # random blocks for every projection (--quantization gguf only)
            return quantizable_weights(self.config)
        return self.gguf_quantized_tensors()

    def gguf_quantized_tensors(self) -> dict[str, str]:
        """HF name -> ggml type name of each GGUF tensor stored in a type the quantized kernels run
        (empty for other formats). Read once from the header: no weight is touched."""
        if self._quantized is None:
            self._quantized = {}
            if self.format == "gguf":
                for tensor in self._reader().tensors:
                    # (llama.cpp's split kv_b is joined and dequantized by the reader: never kept as blocks)
                    if tensor.tensor_type.name in GGUF_QUANT_TYPES and not _GGUF_SPLIT_KV_B.fullmatch(tensor.name):
                        self._quantized[_hf_name(tensor.name, self.config.architecture)] = tensor.tensor_type.name
        return self._quantized

    def _reader(self) -> Any:
        if self._gguf_reader is None:
            self._gguf_reader = _open_gguf(self.path)
        return self._gguf_reader

    def _iter_safetensors(
        self, keep_quantized: frozenset[str], wanted: Callable[[str], bool]
    ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
        from safetensors import safe_open

        files = safetensors_files(self.path)
        if self.hf_quantization is not None:
            yield from self._iter_hf_quantized(files, keep_quantized, wanted)
            return
        entries: list[tuple[str, str]] = []
        sizes: list[int] = []
        for file in files:
            with safe_open(file, framework="pt") as f:
                # A tied head, if saved anyway, is a copy of the embedding the model already has.
                names = [n for n in f.keys()
                         if wanted(n) and not (n == "lm_head.weight" and self.config.tie_word_embeddings)]  # fmt: skip
                sizes += [slice_bytes(f, n) for n in names]  # from the header this handle read already
            entries += [(file, n) for n in names]
        # Several threads read the shards ahead while the model copies in what they have read.
        yield from read_ahead(entries, sizes, workers=min(8, os.cpu_count() or 1))

    def _iter_hf_quantized(
        self, files: list[str], keep_quantized: frozenset[str], wanted: Callable[[str], bool]
    ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
        """A quantized module's tensors may sit in different shards: every file stays open, and a
        module is converted when its first tensor comes up (one module's tensors in memory at a time)."""
        from safetensors import safe_open

        spec = self.hf_quantization
        parts = {n: m for m, names in self.hf_quantized_modules.items() for n in names}
        rounded = 0  # modules whose scales fp16 could not hold exactly
        with contextlib.ExitStack() as stack:
            handles = [stack.enter_context(safe_open(file, framework="pt")) for file in files]
            where = {name: f for f in handles for name in f.keys()}
            for name, f in where.items():
                if name == "lm_head.weight" and self.config.tie_word_embeddings or not wanted(name):
                    continue
                module = parts.get(name)
                if module is None:
                    yield name, f.get_tensor(name)
                    continue
                names = self.hf_quantized_modules[module]
                if name != names[0]:
                    continue  # converted with its module's first tensor
                tensors = {n[len(module) + 1 :]: where[n].get_tensor(n) for n in names}
                weight = unpack_module(spec, module, tensors)
                del tensors
                if f"{module}.weight" in keep_quantized:
                    blocks = weight.to_gguf()
                    rounded += not weight.scales_fit_fp16()
                    yield f"{module}.weight", blocks
                else:
                    yield f"{module}.weight", weight.dequantize()
        if rounded:
            logger.warning("%s: the scales of %d quantized modules were rounded to fp16 for the block kernels",
                           self.path, rounded)  # fmt: skip

    def _iter_gguf(
        self, keep_quantized: frozenset[str], wanted: Callable[[str], bool]
    ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
        from gguf.quants import dequantize

        reader = self._reader()
        cfg = self.config
        # Mistral shares llama.cpp's "llama" architecture and therefore its Q/K permutation.
        permuted = cfg.architecture in ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
        k_b: dict[str, np.ndarray] = {}  # layer prefix -> its attn_k_b, until attn_v_b comes
        for tensor in reader.tensors:
            split_kv = _GGUF_SPLIT_KV_B.fullmatch(tensor.name)
            if split_kv is not None:
                layer, part = split_kv.groups()
                name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
                if not wanted(name):
                    continue
                w = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
                if part == "k":
                    k_b[layer] = w
                    continue
                yield name, torch.from_numpy(_join_kv_b(k_b.pop(layer), w))
                continue
            name = _hf_name(tensor.name, cfg.architecture)
            if name == "lm_head.weight" and cfg.tie_word_embeddings or not wanted(name):
                continue
            if name in keep_quantized:
                # GGUF's shape is (in, out) (experts stacked: (in, out, experts), taken as experts x out
                # rows); rows stay whole blocks, so the Q/K unpermutation moves bytes.
                n_out, n_in = int(np.prod(tensor.shape[1:])), int(tensor.shape[0])
                weight = GGUFWeight.from_numpy(tensor.data, tensor.tensor_type.name, (n_out, n_in))
                if permuted and (".q_proj." in name or ".k_proj." in name):
                    n_head = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
                    order = _unpermute_qk(np.arange(n_out), n_head)
                    weight = weight.rows(torch.from_numpy(np.ascontiguousarray(order)))
                yield name, weight
                continue
            # dequantize returns the numpy (row-major) shape, i.e. GGUF's shape reversed = HF's.
            w = dequantize(tensor.data, tensor.tensor_type)
            if permuted and (".q_proj." in name or ".k_proj." in name):
                n_head = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
                w = _unpermute_qk(w, n_head)
            # F32 tensors come back as read-only views of the file's memory map; torch wants its own copy.
            if w.dtype != np.float32 or not w.flags.writeable or not w.flags.c_contiguous:
                w = np.array(w, dtype=np.float32, order="C")
            if name.endswith(".shared_expert_gate.weight"):
                w = w.reshape(1, -1)  # llama.cpp stores the [1, hidden] gate as a vector
            yield name, torch.from_numpy(w)


_GGUF_SPLIT_KV_B = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight")


def _join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """HF's kv_b_proj [H * (nope + v), rank] from llama.cpp's split: k_b [H, rank, nope] (transposed per
    head) and v_b [H, v, rank]."""
    heads, rank, nope = k_b.shape
    kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return np.ascontiguousarray(kv.reshape(heads * (nope + v_b.shape[1]), rank))


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (weights and biases).

    The converter reorders each head's rows from HF's rotate-half layout to the interleaved
    pairs that ggml's RoPE expects: reshape(n_head, 2, d/2, ...).swapaxes(1, 2).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, architecture: str = "") -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = _GGUF_LAYER_RE.fullmatch(gguf_name)
    gemma = architecture.startswith("Gemma")
    if m is None or m.group(2) not in _GGUF_LAYER_NAMES and not (gemma and m.group(2) in _GGUF_GEMMA_NORMS):
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that ferry knows")
    layer, part, kind = m.groups()
    if gemma and part in _GGUF_GEMMA_NORMS:
        return f"model.layers.{layer}.{_GGUF_GEMMA_NORMS[part]}.{kind}"
    if part == "exp_probs_b":  # DeepSeek-V3's router bias, on the scores the choice is made on
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _open_gguf(path: str) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, OSError, struct.error) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _gguf_architecture(reader: Any) -> tuple[str, str]:
    """Return (GGUF arch prefix for metadata keys, HF architecture class)."""
    arch = _gguf_value(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; ferry reads {', '.join(_GGUF_ARCHITECTURES)} GGUF files"
        )
    hf_arch = _GGUF_ARCHITECTURES[arch]
    # Same rule as transformers' GGUF loader: llama.cpp writes Mistral models as "llama".
    if arch == "llama" and (_gguf_value(reader, "llama.expert_count") or 0) > 0:
        hf_arch = "MixtralForCausalLM"
    elif arch == "deepseek2" and (
        _gguf_value(reader, "deepseek2.expert_gating_func") == 2 or any(t.name.endswith(".exp_probs_b.bias")
                                                                        for t in reader.tensors)
    ):  # fmt: skip
        hf_arch = "DeepseekV3ForCausalLM"  # sigmoid routing with the score-correction bias
    elif arch == "llama" and "mistral" in str(_gguf_value(reader, "general.name", "")).lower():
        hf_arch = "MistralForCausalLM"
    return arch, hf_arch


def _gguf_config(reader: Any) -> ModelConfig:
    arch, hf_arch = _gguf_architecture(reader)
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1+ GGUFs bake the llama3 RoPE scaling into per-frequency factors rather than
        # metadata; ignoring them would silently change every attention score.
        raise ValueError(
            "this GGUF stores RoPE frequency factors (rope_freqs.weight, Llama 3.1+ RoPE scaling), "
            "which ferry does not read yet; use the model's Hugging Face safetensors directory instead"
        )

    def meta(key: str, default: Any = None) -> Any:
        return _gguf_value(reader, f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = meta(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = need("embedding_length")
    heads = need("attention.head_count")
    mla = _gguf_mla_fields(meta) if arch == "deepseek2" else {}
    vocab = meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(meta("rope.scaling.factor", 1.0))}
        for gguf_key, hf_key in _GGUF_ROPE_SCALING_KEYS.items():
            value = meta(f"rope.scaling.{gguf_key}")
            if value is not None:
                rope_scaling[hf_key] = value
        log_mul = meta("rope.scaling.yarn_log_multiplier")
        if log_mul:  # DeepSeek: llama.cpp stores 0.1 * mscale_all_dim (its mscale is the same)
            rope_scaling["mscale"] = rope_scaling["mscale_all_dim"] = float(log_mul) / 0.1
    # llama.cpp stops at any end-of-generation token: EOS, and EOT/EOM where the vocabulary has them.
    eos = [_gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=int(heads),
        num_key_value_heads=int(heads if mla else meta("attention.head_count_kv", heads)),
        # MLA: the rotary key's width (the one per-head size of its cache)
        head_dim=int(
            meta("rope.dimension_count")
            if mla
            else meta("attention.key_length") or meta("rope.dimension_count") or hidden // heads
        ),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=meta("attention.sliding_window"),
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(e) for e in eos if e is not None)),
        # Weights are dequantized to float32 whatever their storage type.
        dtype="float32",
        **_gguf_moe_fields(hf_arch, meta, int(need("block_count")), tensor_names),
        **mla,
        **(
            _gguf_gemma_fields(arch, meta, int(hidden), int(heads), int(need("block_count")))
            if arch in _GGUF_GEMMA
            else {}
        ),
    )


def _gguf_gemma_fields(arch: str, meta: Any, hidden: int, heads: int, layers: int) -> dict[str, Any]:
    """Gemma 2/3 from llama.cpp's metadata, and what its graphs hard-code: every 2nd (Gemma 2) or 6th
    (Gemma 3) layer global unless the file lists the pattern, Gemma 3's local rotary base 10,000, the
    softmax scale 1/sqrt(hidden / heads) for the 27B models (46 / 62 layers) and 1/sqrt(head_dim)
    otherwise. The file's norm weights already hold the 1 of Gemma's (1 + w)."""
    window = meta("attention.sliding_window")
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:  # per layer: True where windowed
        full = tuple(i for i in range(layers) if not pattern[i])
    else:
        every = 2 if arch == "gemma2" else int(pattern or 6)
        full = tuple(i for i in range(layers) if (i + 1) % every == 0)
    head_dim = int(meta("attention.key_length") or hidden // heads)
    big = layers == (46 if arch == "gemma2" else 62)
    return dict(
        full_attention_layers=full if window else (),
        hidden_act="gelu_tanh",
        rms_norm_offset=0.0,
        sandwich_norms=True,
        embed_scale=float(hidden) ** 0.5,
        query_pre_attn_scalar=float(hidden // heads if big else head_dim),
        attn_logit_softcapping=meta("attn_logit_softcapping"),
        final_logit_softcapping=meta("final_logit_softcapping"),
        local_rope_theta=float(meta("rope.freq_base_swa") or 10000.0) if arch == "gemma3" else None,
    )


def _gguf_mla_fields(meta: Any) -> dict[str, Any]:
    """Multi-head latent attention's fields from llama.cpp's deepseek2 metadata. Newer files describe the
    absorbed form in key_length / value_length and the expanded heads in key_length_mla /
    value_length_mla; older ones the expanded heads in key_length / value_length."""
    rope = int(meta("rope.dimension_count"))
    key = meta("attention.key_length_mla") or meta("attention.key_length")
    value = meta("attention.value_length_mla") or meta("attention.value_length")
    return dict(
        kv_lora_rank=int(meta("attention.kv_lora_rank")),
        q_lora_rank=int(meta("attention.q_lora_rank") or 0),
        qk_nope_head_dim=int(key) - rope,
        v_head_dim=int(value),
        rope_interleave=True,  # llama.cpp keeps DeepSeek's adjacent rotary pairs (ggml's "normal" rope)
    )


def _gguf_moe_fields(hf_arch: str, meta: Any, layers: int, tensor_names: set[str]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from llama.cpp's metadata (none for a dense model)."""
    experts = int(meta("expert_count") or 0)
    if experts == 0:
        return {}
    norm = meta("expert_weights_norm")
    if hf_arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        v3 = hf_arch == "DeepseekV3ForCausalLM"
        groups = int(meta("expert_group_count") or 1)
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(meta("expert_used_count") or 0),
            moe_intermediate_size=int(meta("expert_feed_forward_length")),
            norm_topk_prob=bool(norm) if norm is not None else False,
            shared_expert_intermediate_size=int(meta("expert_shared_count") or 0)
            * int(meta("expert_feed_forward_length")),
            shared_expert_gated=False,
            moe_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names),
            moe_scoring="sigmoid" if meta("expert_gating_func") == 2 else "softmax",
            moe_n_group=groups,
            moe_topk_group=int(meta("expert_group_used_count") or 1) if groups > 1 else 1,
            moe_group_score="top2_sum" if v3 else "max",
            moe_score_bias=v3,
            routed_scaling_factor=float(meta("expert_weights_scale") or 1.0),
        )
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(meta("expert_used_count") or 0),
        moe_intermediate_size=int(meta("expert_feed_forward_length") or meta("feed_forward_length")),
        norm_topk_prob=_GGUF_NORM_TOPK[hf_arch] if norm is None else bool(norm),
        shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length") or 0),
        # Layers with a router are sparse (Qwen's mlp_only_layers / decoder_sparse_step leave the others dense).
        moe_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names),
    )


def read_hf_config(directory: str) -> ModelConfig:
    with open(os.path.join(directory, "config.json")) as f:
        d = json.load(f)
    config = ModelConfig.from_hf_dict(d)
    # generation_config.json often lists more stop tokens than config.json (e.g. Llama 3's <|eot_id|>).
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
        extra = gen.get("eos_token_id")
        extra = [extra] if isinstance(extra, int) else (extra or [])
        config.eos_token_ids = list(dict.fromkeys([*config.eos_token_ids, *extra]))
    return config


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _safetensors_contents(files: list[str]) -> tuple[dict[str, str], str | None]:
    """Each tensor's name -> safetensors dtype ("F32", "I8", ...), and the dtype of the
    floating-point weights (headers only)."""
    from safetensors import safe_open

    names: dict[str, str] = {}
    dtype = None
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                names[name] = f.get_slice(name).get_dtype()
                dtype = dtype or _SAFETENSORS_DTYPES.get(names[name])
    return names, dtype


def load_checkpoint(model: str | None, load_format: str = "auto", seed: int = 0) -> Checkpoint:
    """Resolve `model` (None = bundled SmolLM2 GGUF) and read its config; weights stream lazily.

    `load_format="dummy"`: the config only (a GGUF's header, or config.json); `iter_weights`
    then yields random tensors seeded by `seed` and reads no weights file.
    """
    path = resolve_model_path(model, load_format)
    dummy = load_format == "dummy"
    if os.path.isfile(path):
        reader = _open_gguf(path)
        config = _gguf_config(reader)
        fmt = "dummy" if dummy else "gguf"
        logger.info("GGUF checkpoint %s: %s, %d layers%s", path, config.architecture, config.num_hidden_layers,
                    ", random weights" if dummy else "")  # fmt: skip
        return Checkpoint(path=path, config=config, format=fmt, seed=seed, _gguf_reader=reader)

    config = read_hf_config(path)
    if dummy:
        logger.info("%s: %s, %d layers, random weights (seed %d)", path, config.architecture,
                    config.num_hidden_layers, seed)  # fmt: skip
        return Checkpoint(path=path, config=config, format="dummy", seed=seed)
    with open(os.path.join(path, "config.json")) as f:
        quantization = parse_quantization_config(json.load(f).get("quantization_config"))
    names, dtype = _safetensors_contents(safetensors_files(path))
    # The tensors, not config.json (which may lack or misstate it), say what is stored.
    config.dtype = dtype or config.dtype
    if not config.tie_word_embeddings and "lm_head.weight" not in names:
        # Some exports drop the head of a tied model without saying so in config.json.
        logger.warning("%s has no lm_head.weight; tying it to the input embedding", path)
        config.tie_word_embeddings = True
    modules = quantized_modules(quantization, set(names), names) if quantization else {}
    if quantization and not modules:
        raise ValueError(f"{path}: config.json has a {quantization.method} quantization_config, "
                         "but no tensor is stored quantized")  # fmt: skip
    quant = f", {quantization.method} ({len(modules)} quantized modules)" if quantization else ""
    logger.info("safetensors checkpoint %s: %s, %d layers%s", path, config.architecture,
                config.num_hidden_layers, quant)  # fmt: skip
    return Checkpoint(path=path, config=config, format="safetensors", hf_quantization=quantization,
                      hf_quantized_modules=modules)  # fmt: skip
