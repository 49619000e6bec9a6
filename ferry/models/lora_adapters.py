"""LoRA adapters in PEFT's format, read from disk and attached to a loaded model (layers/lora.py).

A PEFT adapter directory holds `adapter_config.json` (LoraConfig: `r`, `lora_alpha`, `use_rslora`,
`rank_pattern`, `alpha_pattern`, ...) and `adapter_model.safetensors` (or `.bin`) with, per adapted
module, `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. The update
of a module is `scale · B A x` with scale = alpha / r (alpha / sqrt(r) with rsLoRA), alpha and r
the module's own where a pattern names it.

Modules are named as the Hugging Face checkpoint names them; q/k/v and gate/up land in ferry's
fused layers at their rows (the loader's own mapping, `LlamaForCausalLM._FUSED`). Refused, with
the reason: DoRA, trained biases, `modules_to_save`, adapted embeddings or output head, expert
layers, and ranks above `--max-lora-rank`. A bad adapter changes nothing in the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch

from ferry.layers.linear import Linear
from ferry.layers.lora import LayerLoRA, LoRADelta, fuse_parts
from ferry.models.llama import Attention, LlamaForCausalLM

_WEIGHT = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight")
_REFUSED_KEYS = ("lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@dataclass
class LoRAAdapter:
    """An adapter read from disk: per module of the Hugging Face model, its update (scale folded)."""

    name: str
    path: str
    rank: int  # the largest of its modules'
    deltas: dict[str, LoRADelta]
    # Of its files: with the name, what its prompts' KV blocks mix into their hashes
    # (core/block_hash.py: lora_hash_key), so another adapter under the same name (a new version,
    # another worker's) never shares K/V.
    digest: str = ""


def read_peft_adapter(name: str, path: str, max_rank: int) -> LoRAAdapter:
    """Read a PEFT LoRA adapter directory; ValueError naming what is wrong or not supported."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a directory (a PEFT adapter's)")
    config_file = os.path.join(path, "adapter_config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {config_file}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {config_file} is not a JSON object")
    _check_config(name, config)
    tensors, weights_file = _read_tensors(name, path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if any(part in key for part in _REFUSED_KEYS):
            raise ValueError(f"LoRA adapter {name!r}: {key} (embedding LoRA or DoRA) is not supported")
        m = _WEIGHT.fullmatch(key)
        if m is None:
            raise ValueError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (only lora_A/lora_B weights)")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: no lora_A/lora_B weights in {path}")
    deltas, top = {}, 0
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {name!r}: {module}: lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)} are not [r, in] and [out, r]")  # fmt: skip
        rank = a.shape[0]
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: {module} has rank {rank}, above --max-lora-rank {max_rank}")
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        deltas[_hf_module(module)] = LoRADelta(a, b * scale)
        top = max(top, rank)
    digest = hashlib.sha256()
    for file in (config_file, weights_file):
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return LoRAAdapter(name, path, top, deltas, digest.hexdigest()[:32])


def _check_config(name: str, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {name!r}: DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {name!r}: modules_to_save (whole modules replaced) is not supported")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {name!r}: fan_in_fan_out (GPT-2's Conv1D layers) is not supported")


def _read_tensors(name: str, path: str) -> tuple[dict[str, torch.Tensor], str]:
    st, pt = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    try:
        if os.path.exists(st):
            from safetensors.torch import load_file

            return load_file(st), st
        if os.path.exists(pt):
            state = torch.load(pt, map_location="cpu", weights_only=True)  # never unpickles code
            if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise ValueError("not a dict of tensors")
            return state, pt
    except Exception as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read its weights in {path}: {e}") from None
    raise ValueError(f"LoRA adapter {name!r}: {path} has no adapter_model.safetensors or adapter_model.bin")


def _pattern_value(pattern: object, module: str, default: object) -> object:
    """PEFT's rank_pattern/alpha_pattern: a key names a module by its full name or a suffix regex."""
    if isinstance(pattern, dict):
        for key, value in pattern.items():
            if module == key or re.fullmatch(rf"(.*\.)?{key}", module):
                return value
    return default


def _hf_module(module: str) -> str:
    """A module's name as ferry's loader takes checkpoint names: no `model.` prefix, ferry's names
    for Mixtral's and DeepSeek's blocks."""
    module = module.removeprefix("model.")
    return module.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.shared_experts.", ".mlp.shared_expert.")


def attach(model: LlamaForCausalLM, slot: int, adapter: LoRAAdapter) -> None:
    """Give the model's layers the adapter's updates under `slot`. Everything is checked before any
    layer changes: a bad adapter leaves the model as it was."""
    param = model.norm.weight
    fused: dict[Linear, list[tuple[int, LoRADelta]]] = {}
    for module, delta in adapter.deltas.items():
        layer, name, shard, row, rows = _target(model, adapter.name, module)
        a, b = delta.a, delta.b
        if model.config.rope_interleave:
            b = model._deinterleave_rope(module + ".weight", b)
        if model.tp.size > 1:  # this rank's part, as its layer's weight is sharded (column: B's rows; row: A's
            # columns, the partial products summed by the layer's all-reduce with the base output's)
            sharding = model._SHARDING.get(name.rsplit(".", 1)[-1])
            if sharding == "column":  # (clones: a view would keep the whole tensor alive on every rank)
                b = model._tensor_parallel_slice(name + ".weight", b, shard).clone()
            elif sharding == "row":
                a = model._tensor_parallel_slice(name + ".weight", a).clone()
        if a.shape[1] != layer.in_features or b.shape[0] != rows:
            raise ValueError(f"LoRA adapter {adapter.name!r}: {module} is [{b.shape[0]}, {a.shape[1]}], the "
                             f"model's is [{rows}, {layer.in_features}]: an adapter of another model?")  # fmt: skip
        fused.setdefault(layer, []).append((row, LoRADelta(a.to(param), b.to(param))))
    for layer, parts in fused.items():
        delta = fuse_parts(parts, layer.out_features)  # (one part covering every row: a copy of it)
        if layer.lora is None:
            layer.lora = LayerLoRA()
        layer.lora.set(slot, delta)


def detach(model: LlamaForCausalLM, slot: int) -> None:
    """Remove slot's updates from every layer."""
    for m in model.modules():
        if isinstance(m, Linear) and m.lora is not None:
            m.lora.remove(slot)
            if not m.lora:
                m.lora = None


def _target(model: LlamaForCausalLM, adapter: str, module: str) -> tuple[Linear, str, int | None, int, int]:
    """The ferry layer holding Hugging Face module `module`, its name, the part of it the module is
    (q/k/v or gate/up; None: the whole layer), and the rows of its output (this rank's) the module makes."""
    parts = module.split(".")
    leaf = parts[-1]
    fused = model._FUSED.get(leaf)
    if fused is not None and not (model.config.is_mla and leaf == "q_proj"):
        name, shard = ".".join(parts[:-1] + [fused[0]]), fused[1]
    else:
        name, shard = module, None
    try:
        layer = model.get_submodule(name)
    except AttributeError:
        layer = None
    if not isinstance(layer, Linear) or ".experts." in name:
        raise ValueError(f"LoRA adapter {adapter!r}: {module} is not a dense linear layer of this model "
                         "(ferry adapts attention and MLP projections, not embeddings, heads or experts)")  # fmt: skip
    if shard is None:
        return layer, name, None, 0, layer.out_features
    parent = model.get_submodule(name.rsplit(".", 1)[0])
    if isinstance(parent, Attention):
        offsets = [0, parent.q_size, parent.q_size + parent.kv_size, layer.out_features]
        return layer, name, shard, offsets[shard], offsets[shard + 1] - offsets[shard]
    half = layer.out_features // 2  # gate/up: the halves of the fused rows
    return layer, name, shard, shard * half, half
