"""The whole-step C++ decode path (ferry/models/cpu_decode_step.py) against the layer-by-layer
Python forward it replaces: same tokens, same logprobs, same KV cache, in real engine steps
(decode rows beside prefill chunks, chunked prefill, prefix-cache hits, bf16 caches), on tiny
random models of each supported layer shape and on the bundled GGUF."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.layers.gguf_linear import GGUFWeight, gguf_available
from ferry.models.cpu_decode_step import CPUDecodeStep
from ferry.models.llama import LlamaForCausalLM, SparseMoeBlock
from ferry.models.weight_arena import gather_gguf_weights, step_order
from ferry.sampling_params import SamplingParams
from ferry.worker.model_loading import load_model
from tests.conftest import assert_no_blocks_referenced, run_to_completion, tiny_llama

pytestmark = pytest.mark.skipif(not gguf_available(), reason="no C++ compiler for the CPU kernels")

# Each projection in another block type, as llama.cpp's mixes do (q/k/v fused from two types).
TYPES = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_1", "gate_up_proj": "Q8_0",
         "down_proj": "Q4_0"}  # fmt: skip


def _gguf(w: torch.Tensor, type_name: str) -> GGUFWeight:
    raw = quantize(w.detach().numpy().astype(np.float32), GGMLQuantizationType[type_name])
    return GGUFWeight.from_numpy(raw, type_name, tuple(w.shape))


def tiny_gguf_model(**overrides) -> LlamaForCausalLM:
    """A random tiny model whose projections run as GGUF blocks, as the loader would leave it."""
    model = tiny_llama(random_norms=True, **overrides)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        qkv = [_gguf(q, TYPES["q_proj"]), _gguf(k, TYPES["k_proj"]), _gguf(v, TYPES["v_proj"])]
        pairs = [(attn.qkv_proj, qkv), (attn.o_proj, [_gguf(attn.o_proj.weight, TYPES["o_proj"])])]
        if not isinstance(mlp, SparseMoeBlock):  # (tiny_gguf_moe_model converts the sparse ones)
            pairs += [(mlp.gate_up_proj, [_gguf(mlp.gate_up_proj.weight, TYPES["gate_up_proj"])]),
                      (mlp.down_proj, [_gguf(mlp.down_proj.weight, TYPES["down_proj"])])]  # fmt: skip
        for linear, parts in pairs:
            linear.drop_weight()
            linear.set_gguf(parts)
    model.quantization = "gguf"
    return model


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


def tiny_gguf_moe_model(**overrides) -> LlamaForCausalLM:
    """tiny_gguf_model's attention, sparse MLPs whose experts are GGUF blocks (expert 0's gate and up
    in two types: two parts), the router and the shared expert's gate in float32."""
    model = tiny_gguf_model(**{**MOE, **overrides})
    for layer in model.layers:
        mlp = layer.mlp
        if not isinstance(mlp, SparseMoeBlock):
            continue
        experts, inter = mlp.experts, mlp.experts.intermediate
        w13, w2 = experts.w13.detach().clone(), experts.w2.detach().clone()
        experts.drop_weights()
        for e in range(experts.num_experts):
            experts.load_gguf("gate", e, _gguf(w13[e, :inter], "Q4_1" if e == 0 else "Q4_0"))
            experts.load_gguf("up", e, _gguf(w13[e, inter:], "Q4_0"))
            experts.load_gguf("down", e, _gguf(w2[e], "Q8_0"))
        experts.pack()
        if mlp.shared_expert is not None:
            shared = mlp.shared_expert
            for linear, kind in ((shared.gate_up_proj, "gate_up_proj"), (shared.down_proj, "down_proj")):
                parts = [_gguf(linear.weight, TYPES[kind])]
                linear.drop_weight()
                linear.set_gguf(parts)
    return model


def generate(model, prompts, step: CPUDecodeStep | None, kv_cache_dtype="auto", **kwargs):
    """Greedy tokens and their logprobs for each prompt, the KV cache afterwards, and how many
    steps the C++ path took."""
    model.cpu_decode_step = step
    taken = []
    if step is not None:  # count the steps it takes
        runs = type(step).runs.__get__(step)
        step.runs = lambda kv, meta: taken.append(runs(kv, meta)) or taken[-1]
    args = EngineArgs(model="tiny", device="cpu", dtype="float32", block_size=4, num_kv_blocks=96,
                      max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype, **kwargs)  # fmt: skip
    engine = LLMEngine(args, model=model, tokenizer=None, device=torch.device("cpu"), dtype=torch.float32)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done = run_to_completion(engine)
    assert_no_blocks_referenced(engine)
    outs = [done[str(i)].outputs[0] for i in range(len(prompts))]
    model.cpu_decode_step = None
    kv = [torch.stack([k, v]).clone() for k, v in engine.runner.kv_caches]
    return [o.token_ids for o in outs], [o.logprobs for o in outs], kv, sum(taken)


SHARED = list(range(10, 30))  # 5 full blocks, cached after the first request
PROMPTS = [SHARED + [40, 41, 42], list(range(50, 59)), SHARED + [60], [7], SHARED + list(range(70, 89))]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"architecture": "Qwen2ForCausalLM", "attention_bias": True},
        {"architecture": "Qwen3ForCausalLM", "qk_norm": True},
        {"architecture": "MistralForCausalLM", "sliding_window": 8},
        {"architecture": "Qwen2ForCausalLM", "sliding_window": 6, "full_attention_layers": (0,)},
    ],  # fmt: skip
    ids=["llama", "qwen2-bias", "qwen3-qk-norm", "mistral-window", "qwen2-local-global"],
)
def test_cpu_decode_step_matches_the_python_forward(overrides):
    model = tiny_gguf_model(**overrides)
    step = CPUDecodeStep.build(model)
    assert step is not None
    ref_tokens, ref_logprobs, ref_kv, _ = generate(model, PROMPTS, None)
    tokens, logprobs, kv, taken = generate(model, PROMPTS, step)
    assert taken > 5  # decode-only steps took the C++ path (mixed ones stayed in Python)
    # The same kernels on the same inputs: bit-identical logprobs and caches.
    assert tokens == ref_tokens and logprobs == ref_logprobs
    for got, ref in zip(kv, ref_kv):
        assert torch.equal(got, ref)


def test_weights_gathered_into_one_arena_compute_the_same():
    """models/weight_arena.py moves every GGUF weight into one huge-page mapping in step order: the
    same bytes (each weight one copy), and the C++ step built over them still matches the Python
    forward bit for bit."""
    model = tiny_gguf_model(hidden_size=256, intermediate_size=1024)  # ~2 MB of blocks: an arena
    for layer in model.layers:  # as the loader leaves them: interleaved for the CPU kernel
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.gguf = [p.interleave() for p in linear.gguf]
    ref_tokens, ref_logprobs, ref_kv, _ = generate(model, PROMPTS, None)
    before = [w.data.clone() for w in step_order(model)]
    assert gather_gguf_weights(model) >= sum(t.numel() for t in before)
    after = step_order(model)
    assert len({w.data.untyped_storage().data_ptr() for w in after}) == 1
    assert [w.data.data_ptr() for w in after] == sorted(w.data.data_ptr() for w in after)
    assert all(torch.equal(b, w.data) for b, w in zip(before, after))
    tokens, logprobs, kv, taken = generate(model, PROMPTS, CPUDecodeStep.build(model))
    assert taken > 5 and tokens == ref_tokens and logprobs == ref_logprobs
    assert all(torch.equal(got, ref) for got, ref in zip(kv, ref_kv))


def test_experts_gathered_into_the_arena_compute_the_same(monkeypatch):
    """The arena takes a mixture's experts (and its shared expert) too, layer by layer."""
    from ferry.utils import lazy_zeros

    monkeypatch.setattr(lazy_zeros, "LAZY_MIN_BYTES", 0)  # gather even a tiny model's blocks
    model = tiny_gguf_moe_model(architecture="Qwen2MoeForCausalLM", moe_layers=(1,), shared_expert_intermediate_size=64)
    step = CPUDecodeStep.build(model)
    ref_tokens, ref_logprobs, ref_kv, _ = generate(model, PROMPTS, step)
    experts = [w for layer in model.layers[1:] for parts in layer.mlp.experts.gguf13 for w in parts]
    experts += [model.layers[1].mlp.shared_expert.down_proj.gguf[0], model.layers[0].mlp.down_proj.gguf[0]]
    assert gather_gguf_weights(model) > 0
    in_order = step_order(model)
    assert all(any(w is x for x in in_order) for w in experts)
    assert len({w.data.untyped_storage().data_ptr() for w in in_order}) == 1
    tokens, logprobs, kv, taken = generate(model, PROMPTS, CPUDecodeStep.build(model))
    assert taken > 5 and tokens == ref_tokens and logprobs == ref_logprobs
    assert all(torch.equal(got, ref) for got, ref in zip(kv, ref_kv))


@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_decode_step_is_the_same_on_any_number_of_threads(threads):
    """Each matmul's output rows are split between the threads at multiples of 8 (the interleaved
    groups) and the decode attention's partitions are claimed by whichever thread is free: which
    thread computes a value must never change it. One thread runs every loop itself; three on a
    2-core machine split the rows in thirds, oversubscribed."""
    model = tiny_gguf_model(hidden_size=256, intermediate_size=704)  # more row groups than threads
    step = CPUDecodeStep.build(model)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # (both paths: the Python one's torch ops split by thread count too)
    try:
        ref_tokens, ref_logprobs, ref_kv, _ = generate(model, PROMPTS, None)
        tokens, logprobs, kv, taken = generate(model, PROMPTS, step)
    finally:
        torch.set_num_threads(before)
    assert taken > 5
    assert tokens == ref_tokens and logprobs == ref_logprobs
    for got, ref in zip(kv, ref_kv):
        assert torch.equal(got, ref)


@pytest.mark.parametrize(
    "overrides",
    [
        {"architecture": "Qwen3MoeForCausalLM", "qk_norm": True, "moe_layers": (0, 1)},
        {
            "architecture": "Qwen2MoeForCausalLM",
            "attention_bias": True,
            "moe_layers": (1,),
            "norm_topk_prob": False,
            "shared_expert_intermediate_size": 96,
        },
        {"architecture": "MixtralForCausalLM", "moe_layers": (0, 1), "routed_scaling_factor": 1.5},
    ],  # fmt: skip
    ids=["qwen3-moe", "qwen2-moe-shared-dense-mix", "mixtral-scaled"],
)
def test_cpu_decode_step_runs_mixtures_of_experts(overrides):
    """Sparse layers in the C++ step (routing, experts in token order, the shared expert and its
    gate, a dense layer beside a sparse one) give the Python forward's bits, batched rows routed to
    different experts included."""
    model = tiny_gguf_moe_model(**overrides)
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    step = CPUDecodeStep.build(model)
    assert step is not None
    ref_tokens, ref_logprobs, ref_kv, _ = generate(model, PROMPTS, None)
    tokens, logprobs, kv, taken = generate(model, PROMPTS, step)
    assert taken > 5
    assert tokens == ref_tokens and logprobs == ref_logprobs
    assert all(torch.equal(got, ref) for got, ref in zip(kv, ref_kv))


def test_cpu_decode_step_leaves_deepseek_routing_to_python():
    model = tiny_gguf_moe_model(architecture="Qwen3MoeForCausalLM", moe_layers=(0, 1), moe_scoring="sigmoid")
    assert CPUDecodeStep.build(model) is None


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("shape", [{}, {"head_dim": 40, "num_key_value_heads": 1}], ids=["gqa", "mqa-d40"])
def test_cpu_decode_step_with_a_narrow_cache(kv_cache_dtype, shape):
    """bf16 rounding, int8 / fp8 quantization of K/V (values and scales) written by the C++ step
    are the Python path's, byte for byte (rows of 40 values: the vector stores' partial last step)."""
    model = tiny_gguf_model(**shape)
    step = CPUDecodeStep.build(model)
    ref_tokens, ref_logprobs, ref_kv, _ = generate(model, PROMPTS, None, kv_cache_dtype=kv_cache_dtype)
    tokens, logprobs, kv, taken = generate(model, PROMPTS, step, kv_cache_dtype=kv_cache_dtype)
    assert taken > 5 and tokens == ref_tokens and logprobs == ref_logprobs
    dtypes = {"bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
    assert ref_kv[0].dtype == dtypes[kv_cache_dtype]
    assert all(torch.equal(g.view(torch.uint8), r.view(torch.uint8)) for g, r in zip(kv, ref_kv))


def test_which_models_and_steps_take_it(tmp_path):
    model = tiny_gguf_model()
    model.quantization = None
    assert CPUDecodeStep.build(model) is None  # float weights: the Python forward (oneDNN GEMMs)
    model.quantization = "gguf"
    assert CPUDecodeStep.build(model) is not None
    down = model.layers[1].mlp.down_proj.gguf[0]
    down.input_order = torch.arange(down.in_features).flip(0)  # GPTQ desc_act: not in C++ yet
    assert CPUDecodeStep.build(model) is None
    # Loading: a quantized GGUF gets the C++ step unless --enforce-eager.
    eager = load_model(EngineArgs(device="cpu", enforce_eager=True, num_kv_blocks=16))
    assert eager.model.quantization == "gguf" and eager.model.cpu_decode_step is None
    del eager
    dense = load_model(EngineArgs(device="cpu", quantization="none", num_kv_blocks=16))
    assert dense.model.cpu_decode_step is None


def test_bad_inputs_are_errors_not_crashes():
    model = tiny_gguf_model()
    step = CPUDecodeStep.build(model)._step
    kv = torch.zeros(4, 4, 2, 32)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)

    def forward(hidden=128, position=0, slot=0, caches=2):
        x, pos, slots = torch.zeros(1, hidden), torch.tensor([position]), torch.tensor([slot])
        return step.forward(x, pos, slots, tables, lens, [kv] * caches, [kv] * caches)

    assert forward().shape == (1, 128)
    with pytest.raises(RuntimeError, match="position"):
        forward(position=10_000)
    with pytest.raises(RuntimeError, match="slot"):
        forward(slot=16)  # 4 blocks of 4 slots
    with pytest.raises(RuntimeError, match="one K and one V cache per layer"):
        forward(caches=1)
    with pytest.raises(RuntimeError, match="x must be"):
        forward(hidden=64)
    x, pos, slot = torch.zeros(1, 128), torch.tensor([0]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="layer_view: one entry per layer"):
        step.forward(x, pos, slot, tables, lens, [kv] * 2, [kv] * 2, None, [0], [tables], [lens], [lens])
    with pytest.raises(RuntimeError, match="names view 1 of 1"):
        step.forward(x, pos, slot, tables, lens, [kv] * 2, [kv] * 2, None, [-1, 1], [tables], [lens], [lens])
