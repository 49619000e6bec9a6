"""Mixture-of-experts: routing, the grouped experts, configs, and GGUF loading (llama.cpp's names).

Token-exact parity of whole MoE models with HF transformers is in tests/test_hf_parity.py, tensor
parallelism in tests/worker/test_tensor_parallel.py.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import engine_over
from test_hf_parity import ferry_greedy, hf_greedy
from test_loader import _llama_cpp_permute, gguf_writer_with_header  # llama.cpp's converter, as the tests write it

from ferry.config import EngineArgs
from ferry.distributed.parallel_state import SINGLE
from ferry.layers.fused import silu_and_mul
from ferry.layers.moe import FusedMoE, grouped_experts, select_experts
from ferry.models.config import ModelConfig
from ferry.models.loader import load_checkpoint
from ferry.worker.model_loading import load_model


def dense_reference(x, w13, w2, weights, ids):
    """Every token through each of its chosen experts, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_grouped_experts_equal_each_token_through_its_experts(tokens):
    g = torch.Generator().manual_seed(tokens)
    E, k, H, inter = 6, 2, 32, 24
    x = torch.randn(tokens, H, generator=g)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    weights, ids = select_experts(torch.randn(tokens, E, generator=g), k, renormalize=True)
    expected = dense_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, ids), expected, rtol=1e-5, atol=1e-4)
    moe = FusedMoE(E, H, inter, SINGLE)
    for e in range(E):
        moe.load("gate", e, w13[e, :inter])
        moe.load("up", e, w13[e, inter:])
        moe.load("down", e, w2[e])
    moe.pack()  # oneDNN copies per expert (the CPU path)
    assert moe.w13 is None and len(moe.packed13) == E
    torch.testing.assert_close(moe(x, weights, ids), expected, rtol=1e-5, atol=1e-4)


def test_select_experts_softmax_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[:, [1, 2]])
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))


def test_expert_loading_rejects_wrong_shapes_and_indices():
    moe = FusedMoE(4, 16, 8, SINGLE)
    with pytest.raises(ValueError, match="expected"):
        moe.load("gate", 0, torch.zeros(9, 16))
    with pytest.raises(ValueError, match="out of range"):
        moe.load("down", 4, torch.zeros(16, 8))
    with pytest.raises(ValueError, match="unknown expert projection"):
        moe.load("side", 0, torch.zeros(8, 16))


def _hf_dict(arch: str, **extra) -> dict:
    d = dict(architectures=[arch], vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return {**d, **extra}


def test_qwen_moe_config_places_sparse_layers_like_hf():
    d = _hf_dict("Qwen2MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                 shared_expert_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3])  # fmt: skip
    cfg = ModelConfig.from_hf_dict(d)
    hf = transformers.Qwen2MoeConfig(**{k: v for k, v in d.items() if k != "architectures"})
    hf_sparse = [i for i in range(4) if transformers.Qwen2MoeForCausalLM(hf).model.layers[i].mlp.__class__.__name__
                 == "Qwen2MoeSparseMoeBlock"]  # fmt: skip
    assert cfg.moe_layers == tuple(hf_sparse) == (1,)
    assert cfg.attention_bias and not cfg.norm_topk_prob and cfg.shared_expert_intermediate_size == 32
    mixtral = ModelConfig.from_hf_dict(_hf_dict("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2))
    assert mixtral.moe_layers == (0, 1, 2, 3) and mixtral.moe_intermediate_size == 64 and mixtral.norm_topk_prob
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict(_hf_dict("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=5,
                                          moe_intermediate_size=16))  # fmt: skip


def test_int8_weights_are_refused_for_moe_models(tmp_path):
    cfg = transformers.Qwen3MoeConfig(**_common(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="int8 does not cover mixture-of-experts"):
        load_model(EngineArgs(model=str(tmp_path), device="cpu", dtype="float32", quantization="int8"))


# ---------------------------------------------------------------- GGUF (llama.cpp's MoE tensors)


def _common() -> dict:
    return dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                tie_word_embeddings=False)  # fmt: skip


_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}


def _expert_blocks(a: np.ndarray, expert_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """Stacked expert weights [E, rows, in] as `expert_type` blocks; K-quants (which gguf-py cannot
    quantize) as random super-blocks with small scales instead of `a`'s values."""
    if expert_type.name.endswith("_K"):
        from ferry.layers.gguf_linear import GGUF_QUANT_TYPES

        # Random quants and 6-bit sub-scales; super-scales so small that weights keep HF's init spread.
        n, size = a.size // 256, GGUF_QUANT_TYPES[expert_type.name][2]
        raw = np.random.default_rng(a.size).integers(0, 256, size=(n, size), dtype=np.uint8)
        scales = np.full(n, 2e-4, np.float16).view(np.uint8).reshape(n, 2)
        if expert_type.name == "Q6_K":
            raw[:, 208:210] = scales
        else:
            raw[:, 0:2], raw[:, 2:4] = scales, scales
        return raw.reshape(*a.shape[:-1], -1)
    return gguf.quants.quantize(np.ascontiguousarray(a), expert_type)


def _write_moe_gguf(path: str, arch: str, model, expert_type: gguf.GGMLQuantizationType) -> None:
    """`model` as llama.cpp's converter writes it: experts stacked per layer (ffn_*_exps), Q/K permuted
    for "llama" (Mixtral), the shared expert's gate a vector; expert tensors stored as `expert_type`."""
    cfg = model.config
    w = gguf_writer_with_header(path, arch, cfg)
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for name, t in model.state_dict().items():
        a = t.numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]  # fmt: skip
            w.add_tensor(gname, np.ascontiguousarray(a))
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # transformers 5 holds them fused: [E, 2I, H]
            gate, up = np.split(a, 2, axis=1)
            for gname, part in (("ffn_gate_exps.weight", gate), ("ffn_up_exps.weight", up)):
                w.add_tensor(blk + gname, _expert_blocks(part, expert_type), raw_dtype=expert_type)
        elif rest == "mlp.experts.down_proj":
            w.add_tensor(blk + "ffn_down_exps.weight", _expert_blocks(a, expert_type), raw_dtype=expert_type)
        elif rest == "mlp.shared_expert_gate.weight":
            w.add_tensor(blk + "ffn_gate_inp_shexp.weight", np.ascontiguousarray(a.reshape(-1)))
        else:
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                a = _llama_cpp_permute(a, cfg.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                a = _llama_cpp_permute(a, cfg.num_key_value_heads)
            w.add_tensor(blk + _LAYER[rest], np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_MOE_GGUF = {
    "llama": lambda: transformers.MixtralConfig(**_common(), num_local_experts=4, num_experts_per_tok=2),
    "qwen2moe": lambda: transformers.Qwen2MoeConfig(**_common(), num_experts=6, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "qwen3moe": lambda: transformers.Qwen3MoeConfig(**_common(), num_experts=6, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
}  # fmt: skip


@pytest.mark.parametrize("arch", list(_MOE_GGUF))
def test_moe_gguf_matches_hf_greedy(tmp_path, arch):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_MOE_GGUF[arch](), dtype=torch.float32).eval()
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_moe_gguf(path, arch, hf, gguf.GGMLQuantizationType.F32)
    cfg = load_checkpoint(path).config
    assert cfg.architecture == type(hf).__name__ and cfg.moe_layers == (0, 1)
    assert cfg.norm_topk_prob is (arch != "qwen2moe")  # llama.cpp's per-architecture choice
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 23)]
    expected = [hf_greedy(hf, ids, 12) for ids in prompts]
    # No vocabulary in the file: token ids in, token ids out (the tokenizer path has no tokenizer files).
    args = EngineArgs(model=path, tokenizer=str(tmp_path), device="cpu", dtype="float32")
    engine = engine_over(load_model(args), num_kv_blocks=32)
    assert ferry_greedy(engine, prompts, 12) == expected


def test_quantized_gguf_experts_are_dequantized_exactly(tmp_path):
    """`--quantization none` (the reference path, and what CUDA's fused-MoE kernel takes): a GGUF's
    quantized experts dequantized to the model dtype, value for value."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_MOE_GGUF["qwen3moe"](), dtype=torch.float32)
    path = str(tmp_path / "q8-experts.gguf")
    _write_moe_gguf(path, "qwen3moe", hf, gguf.GGMLQuantizationType.Q8_0)
    model = load_model(EngineArgs(model=path, tokenizer=str(tmp_path), device="cpu", dtype="float32",
                                  quantization="none")).model  # fmt: skip
    experts = model.layers[1].mlp.experts
    ref = hf.state_dict()["model.layers.1.mlp.experts.down_proj"].numpy()
    want = gguf.quants.dequantize(gguf.quants.quantize(ref, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    got = torch.stack([p.to_dense() for p in experts.packed2]) if experts.w2 is None else experts.w2
    assert not np.array_equal(want, ref)  # Q8_0 rounds: the check below tells the two apart
    np.testing.assert_array_equal(got.detach().numpy(), want)


# ---------------------------------------------------------------- GGUF experts run as stored (CPU)


def _quantized_moe(tmp_path, expert_type, **overrides):
    """A Qwen3-MoE GGUF whose experts are stored as `expert_type` (the rest F32), loaded as users run it
    (experts kept as blocks) and dequantized (`--quantization none`)."""
    torch.manual_seed(0)
    cfg = {**_common(), "moe_intermediate_size": 32, **overrides}
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3MoeConfig(**cfg, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16),
        dtype=torch.float32,
    )
    path = str(tmp_path / f"moe-{expert_type.name}.gguf")
    _write_moe_gguf(path, "qwen3moe", hf, expert_type)
    args = dict(model=path, tokenizer=str(tmp_path), device="cpu", dtype="float32")
    return load_model(EngineArgs(**args)), load_model(EngineArgs(**args, quantization="none"))


@pytest.mark.parametrize("expert_type", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0])
def test_gguf_experts_keep_their_blocks_and_compute_per_token(tmp_path, expert_type):
    """The experts hold the file's blocks and nothing else, and the grouped kernels give each token what
    its experts give it alone (the CPU kernel computes a row the same whatever rows are beside it)."""
    from ferry.layers.gguf_linear import gguf_linear
    from ferry.models.weight_memory import held_weight_bytes

    loaded, dequantized = _quantized_moe(tmp_path, expert_type)
    experts = loaded.model.layers[1].mlp.experts
    assert experts.w13 is None and experts.packed13 is None and len(experts.gguf13) == 6
    block_bytes = sum(p.nbytes for parts in experts.gguf13 for p in parts) + sum(p.nbytes for p in experts.gguf2)
    float_bytes = 6 * 3 * 64 * 32 * 4
    assert block_bytes < float_bytes * (0.3 if expert_type.name == "Q8_0" else 0.16)
    held = held_weight_bytes(loaded.model)
    assert held["experts"] == 2 * block_bytes  # two sparse layers, blocks only
    assert held_weight_bytes(dequantized.model)["experts"] == 2 * float_bytes
    x = torch.randn(9, 64)
    weights, ids = select_experts(torch.randn(9, 6), 2, renormalize=True)
    got = experts(x, weights, ids)
    for t in range(9):
        ref = torch.zeros(64)
        for j in range(2):
            e = int(ids[t, j])
            h = silu_and_mul(gguf_linear(x[t : t + 1], experts.gguf13[e], None))
            ref += weights[t, j] * gguf_linear(h, [experts.gguf2[e]], None)[0]
        torch.testing.assert_close(got[t], ref, rtol=1e-5, atol=1e-6)


def test_k_quant_experts_route_prompt_and_decode_rows_as_dense_layers_do(tmp_path):
    """Q4_K experts inside a step: decode rows take the int8 dots and prompt rows the exact path, per
    expert group (an expert's rows keep the batch order, so its decode rows come first), as a dense
    layer routes them: each row computes what it computes in a step of its own kind alone. In the
    engine, requests alone and in chunked steps beside each other's decode rows pick the same tokens,
    and each prompt's first token (from exact prompt rows) is the dequantized model's."""
    from ferry.layers.gguf_linear import step_decode_rows

    loaded, dequantized = _quantized_moe(tmp_path, gguf.GGMLQuantizationType.Q4_K, hidden_size=256,
                                         moe_intermediate_size=256)  # fmt: skip
    experts = loaded.model.layers[0].mlp.experts
    assert experts.gguf13[0][0].type_name == "Q4_K"
    T, nd = 12, 5  # 5 decode rows, then 7 prompt rows
    x = torch.randn(T, 256) * 0.5
    weights, ids = select_experts(torch.randn(T, 6), 2, renormalize=True)
    with step_decode_rows(nd):
        got = experts(x, weights, ids)
    for t in range(T):
        with step_decode_rows(1 if t < nd else 0):
            alone = experts(x[t : t + 1], weights[t : t + 1], ids[t : t + 1])
        torch.testing.assert_close(got[t], alone[0], rtol=1e-5, atol=1e-6)
    with step_decode_rows(0):  # the int8 dots and the exact path differ: the check above can tell
        assert not torch.allclose(experts(x[:1], weights[:1], ids[:1]), got[:1], atol=1e-4)

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 19)]
    engine = engine_over(loaded, num_kv_blocks=64)
    alone = [ferry_greedy(engine, [p], 5)[0] for p in prompts]
    assert ferry_greedy(engine_over(loaded, num_kv_blocks=64, max_num_batched_tokens=6), prompts, 5) == alone
    exact = ferry_greedy(engine_over(dequantized, num_kv_blocks=64), prompts, 5)
    assert [a[0] for a in alone] == [e[0] for e in exact]


def test_gguf_experts_shard_over_tp2(tmp_path):
    """Under TP=2 each rank keeps its half of every expert as blocks (gate/up rows, whole blocks of down's
    columns), or with expert parallelism half the experts whole, and both decode TP=1's tokens."""
    from conftest import run_to_completion

    from ferry.engine.llm_engine import LLMEngine
    from ferry.sampling_params import SamplingParams

    _quantized_moe(tmp_path, gguf.GGMLQuantizationType.Q8_0, moe_intermediate_size=64)
    path = str(tmp_path / "moe-Q8_0.gguf")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19)]

    def run(tp: int, **kwargs):
        engine = LLMEngine(EngineArgs(model=path, tokenizer=str(tmp_path), device="cpu", dtype="float32",
                                      tensor_parallel_size=tp, num_kv_blocks=32, **kwargs))  # fmt: skip
        try:
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            for i, ids in enumerate(prompts):
                engine.add_request(str(i), {"prompt_token_ids": ids}, params)
            done = run_to_completion(engine)
            experts = engine.model.layers[0].mlp.experts
            return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))], experts
        finally:
            engine.shutdown()

    ref, _ = run(1)
    got, experts = run(2)
    assert got == ref
    assert len(experts.gguf13) == 6 and experts.gguf13[0][0].out_features == 2 * 32  # gate + up, half each
    assert experts.gguf2[0].in_features == 32
    got, experts = run(2, enable_expert_parallel=True)
    assert got == ref and len(experts.gguf13) == 3 and experts.gguf2[0].in_features == 64
