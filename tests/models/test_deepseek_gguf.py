"""DeepSeek-V2/V3 from GGUF files written as llama.cpp's converter writes them ("deepseek2": multi-head
latent attention's tensors, kv_b whole in older files and split into attn_k_b / attn_v_b in newer
ones, the expert metadata, YaRN as a log multiplier), against HF transformers' greedy tokens."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import engine_over
from test_hf_parity import ferry_greedy, hf_greedy
from test_loader import gguf_writer_with_header
from test_moe import _expert_blocks

from ferry.config import EngineArgs
from ferry.layers.gguf_linear import GGUFWeight
from ferry.models.loader import load_checkpoint
from ferry.worker.model_loading import load_model

_ATTN = {
    "q_proj": "attn_q",
    "q_a_proj": "attn_q_a",
    "q_a_layernorm": "attn_q_a_norm",
    "q_b_proj": "attn_q_b",
    "kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "kv_a_layernorm": "attn_kv_a_norm",
    "o_proj": "attn_output",
}
_MLP = {
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
    "shared_experts.gate_proj": "ffn_gate_shexp",
    "shared_experts.up_proj": "ffn_up_shexp",
    "shared_experts.down_proj": "ffn_down_shexp",
    "gate": "ffn_gate_inp",
}


def _config(version: int):
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.2, kv_lora_rank=32,
                  qk_nope_head_dim=32, qk_rope_head_dim=8, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, first_k_dense_replace=1, tie_word_embeddings=False)  # fmt: skip
    if version == 2:
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip
        return transformers.DeepseekV2Config(q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
                                             n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                             rope_parameters=yarn, **common)  # fmt: skip
    return transformers.DeepseekV3Config(q_lora_rank=32, n_shared_experts=1, n_group=4, topk_group=2,
                                         norm_topk_prob=True, routed_scaling_factor=2.5, **common)  # fmt: skip


def _write(path: str, model, split_kv_b: bool, proj_type=gguf.GGMLQuantizationType.F32) -> None:
    """`model` as llama.cpp's DeepseekV2Model converter writes it: the MLA hyper-parameters (newer files
    describe the absorbed heads in key/value_length and the expanded ones in *_mla), experts stacked,
    kv_b split per head (k_b transposed) when `split_kv_b`; 2-D projections stored as `proj_type`."""
    cfg = model.config
    rope, nope, v, rank = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if split_kv_b:  # the absorbed heads: one latent "KV head" of rank + rope, values of rank
        w = gguf_writer_with_header(path, "deepseek2", cfg, rank + rope, rank, head_count_kv=1)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w = gguf_writer_with_header(path, "deepseek2", cfg, nope + rope, v, head_count_kv=cfg.num_attention_heads)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(rank)
    w.add_rope_dimension_count(rope)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    v3 = isinstance(cfg, transformers.DeepseekV3Config)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if cfg.rope_parameters.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
        w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope_parameters["mscale_all_dim"])

    def add(name: str, a: np.ndarray, quantize: bool = False) -> None:
        if quantize and proj_type != gguf.GGMLQuantizationType.F32 and a.ndim == 2 and a.shape[1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), proj_type), raw_dtype=proj_type)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))

    for name, t in model.state_dict().items():
        a = t.numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            add({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name], a)  # fmt: skip
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            add(blk + ("attn_norm.weight" if rest.startswith("input") else "ffn_norm.weight"), a)
        elif rest == "self_attn.kv_b_proj.weight":
            if not split_kv_b:
                add(blk + "attn_kv_b.weight", a, quantize=True)
                continue
            kv_b = a.reshape(cfg.num_attention_heads, nope + v, rank)
            add(blk + "attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1), quantize=True)
            add(blk + "attn_v_b.weight", kv_b[:, nope:], quantize=True)
        elif rest.startswith("self_attn."):
            module, kind = rest[len("self_attn.") :].rsplit(".", 1)
            add(blk + f"{_ATTN[module]}.{kind}", a, quantize=True)
        elif rest == "mlp.experts.gate_up_proj":  # transformers 5 holds them fused: [E, 2I, H]
            gate, up = np.split(a, 2, axis=1)
            for gname, part in (("ffn_gate_exps.weight", gate), ("ffn_up_exps.weight", up)):
                w.add_tensor(blk + gname, _expert_blocks(part, gguf.GGMLQuantizationType.Q8_0),
                             raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        elif rest == "mlp.experts.down_proj":
            w.add_tensor(blk + "ffn_down_exps.weight", _expert_blocks(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        elif rest == "mlp.gate.e_score_correction_bias":
            add(blk + "exp_probs_b.bias", a)
        else:
            module, kind = rest[len("mlp.") :].rsplit(".", 1)
            add(blk + f"{_MLP[module]}.{kind}", a, quantize=module != "gate")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("version,split_kv_b", [(2, False), (2, True), (3, True)], ids=["v2-kv_b", "v2-split", "v3"])
def test_deepseek_gguf_matches_hf_greedy(tmp_path, version, split_kv_b):
    """F32 projections (the experts in Q8_0, dequantized: the HF model gets the same rounded experts):
    the config read from llama.cpp's metadata builds HF's model, and the greedy tokens are HF's."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_config(version), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0, 0.3)
            experts = getattr(layer.mlp, "experts", None)
            for p in experts.parameters() if experts is not None else ():  # Q8_0 in the file: round HF's too
                q = gguf.quants.quantize(p.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
    path = str(tmp_path / "tiny-deepseek.gguf")
    _write(path, hf, split_kv_b)
    cfg = load_checkpoint(path).config
    assert cfg.architecture == type(hf).__name__ and cfg.is_mla and cfg.moe_layers == (1, 2)
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.head_dim) == (32, 32, 32, 8)
    assert cfg.moe_n_group == 4 and cfg.moe_topk_group == 2 and cfg.routed_scaling_factor == 2.5
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 23)]
    expected = [hf_greedy(hf, ids, 12) for ids in prompts]
    args = EngineArgs(model=path, tokenizer=str(tmp_path), device="cpu", dtype="float32", quantization="none")
    assert ferry_greedy(engine_over(load_model(args), num_kv_blocks=32), prompts, 12) == expected


def test_deepseek_gguf_runs_its_projections_as_blocks(tmp_path):
    """Q8_0 projections: the latent attention's Linear layers keep the blocks (the rotary rows of q_b and
    kv_a moved as whole quantized rows), kv_b is dequantized (the absorbed decode reads it per head),
    the experts stay blocks; the model runs as it is stored and stays near the dequantized one."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_config(3), dtype=torch.float32).eval()
    path = str(tmp_path / "q8-deepseek.gguf")
    _write(path, hf, split_kv_b=True, proj_type=gguf.GGMLQuantizationType.Q8_0)
    args = dict(model=path, tokenizer=str(tmp_path), device="cpu", dtype="float32")
    loaded = load_model(EngineArgs(**args))
    attn = loaded.model.layers[1].self_attn
    assert loaded.model.quantization == "gguf"
    assert attn.q_b_proj.weight is None and isinstance(attn.q_b_proj.gguf[0], GGUFWeight)
    assert attn.kv_a_proj_with_mqa.weight is None and attn.kv_b_proj.weight is not None
    assert loaded.model.layers[1].mlp.experts.gguf13 is not None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 17)]
    got = ferry_greedy(engine_over(loaded, num_kv_blocks=32), prompts, 8)
    ref = ferry_greedy(engine_over(load_model(EngineArgs(**args, quantization="none")), num_kv_blocks=32), prompts, 8)
    assert [g_[0] for g_ in got] == [r[0] for r in ref]  # the first token: before any divergence can compound
