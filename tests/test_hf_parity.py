"""Token-exact greedy parity with Hugging Face transformers on the same fp32 weights.

Each engine configuration (one request at a time, all batched, warm prefix
cache, tiny prefill chunks, a KV cache so small that preemption must happen)
must reproduce HF's greedy continuation of every prompt exactly.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_blocks_referenced, engine_over, run_to_completion

from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.sampling_params import SamplingParams
from ferry.worker.model_loading import load_model

MAX_TOKENS = 24
SHARED = (
    "You are a careful assistant. Answer briefly and precisely, and say so when you do not know. "
    "The user is a student who is learning about geography and history. "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    SHARED + "Question: what is the largest ocean on Earth?",
    SHARED + "Question: who built the pyramids of Giza?",
    "1, 2, 3, 4,",
]


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    hf_model.generation_config.eos_token_id = None  # like ignore_eos: always max_new_tokens
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt_ids) :].tolist()


def ferry_greedy(engine: LLMEngine, prompts_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts_ids):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done = run_to_completion(engine)
    assert_no_blocks_referenced(engine)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts_ids))]


# ---------------------------------------------------------------- SmolLM2 (GGUF)


@pytest.fixture(scope="module")
def smol_reference(smollm, smollm_hf):
    tokenizer = smollm[1]
    prompts_ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(smollm_hf, ids, MAX_TOKENS) for ids in prompts_ids]
    return prompts_ids, expected


def test_smollm_one_at_a_time(make_engine, smol_reference):
    prompts_ids, expected = smol_reference
    engine = make_engine()
    for ids, exp in zip(prompts_ids, expected):
        assert ferry_greedy(engine, [ids], MAX_TOKENS) == [exp]


def test_smollm_batched(make_engine, smol_reference):
    prompts_ids, expected = smol_reference
    assert ferry_greedy(make_engine(), prompts_ids, MAX_TOKENS) == expected


def test_smollm_warm_prefix_cache(make_engine, smol_reference):
    prompts_ids, expected = smol_reference
    engine = make_engine()
    ferry_greedy(engine, prompts_ids[2:3], MAX_TOKENS)  # warms the shared system prefix
    hits_before = engine.get_stats().prefix_cache_hits
    assert ferry_greedy(engine, prompts_ids, MAX_TOKENS) == expected
    stats = engine.get_stats()
    # Both shared-prefix prompts hit at least the full blocks of the system text.
    assert stats.prefix_cache_hits - hits_before >= 2 * (len(prompts_ids[2]) // 16 - 1) * 16


def test_smollm_tiny_chunks(make_engine, smol_reference):
    prompts_ids, expected = smol_reference
    engine = make_engine(max_num_batched_tokens=7, enable_prefix_caching=False)
    assert ferry_greedy(engine, prompts_ids, MAX_TOKENS) == expected


def test_smollm_preemption(make_engine, smol_reference):
    prompts_ids, expected = smol_reference
    longest = max(len(p) for p in prompts_ids) + MAX_TOKENS
    # Room for about two sequences at a time: the others must be preempted and recomputed.
    engine = make_engine(block_size=4, num_kv_blocks=2 * (longest // 4 + 1) + 2, max_model_len=longest + 4)
    assert ferry_greedy(engine, prompts_ids, MAX_TOKENS) == expected
    assert engine.get_stats().num_preemptions > 0


# ---------------------------------------------------- tiny random-weight configs


def _tiny_config(arch: str):
    import transformers

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    if arch == "mistral_window":  # a 16-token window: prompts of 17-40 tokens and 24 more reach past it
        return transformers.MistralConfig(sliding_window=16, **common)
    # Mixtures of experts: every expert's weights random, so routing differs token to token.
    if arch == "mixtral":
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    if arch == "qwen2moe":  # with the sigmoid-gated shared expert, top-k weights not renormalised
        return transformers.Qwen2MoeConfig(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96, **common
        )
    if arch == "qwen3moe":  # layer 1 dense (mlp_only_layers), top-3 renormalised
        return transformers.Qwen3MoeConfig(
            num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
            mlp_only_layers=[1], head_dim=16, **common,
        )  # fmt: skip
    # Multi-head latent attention (a 32-wide latent + 8-wide rotary key cached per token) with DeepSeek's
    # routing: V2 softmax-scored, top 2 of the best 2 of 4 expert groups, weights x 2.5, YaRN rotary
    # with mscale in the softmax scale; V3 a q_lora bottleneck, sigmoid scores with a per-expert bias
    # on the choice (randomised in the fixture: HF starts it at zero), renormalised.
    mla = dict(
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        **{**common, "num_key_value_heads": 4},
    )  # HF's MLA repeats K/V by heads / kv_heads
    if arch == "deepseek_v2":
        yarn = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        }
        return transformers.DeepseekV2Config(
            q_lora_rank=None,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            rope_parameters=yarn,
            **mla,
        )
    if arch == "deepseek_v3":
        return transformers.DeepseekV3Config(
            q_lora_rank=24, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, **mla
        )
    # Gemma: a 16-token window on its local layers (prompts of 17-40 tokens and 24 more reach past it),
    # global layers beside them, GeGLU, (1 + w) sandwich norms, a scaled embedding, a softmax scale
    # from query_pre_attn_scalar (not head_dim); Gemma 2 soft-caps its scores and logits (at 1 and 3,
    # far tighter than its real 50 and 30, so that the caps change this tiny model's tokens and
    # logprobs), Gemma 3 norms q/k and has its own rotary base (and here a linearly scaled global one)
    # on the local layers. HF's eager attention: the one that soft-caps.
    gemma = dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=24, **{**common, "num_hidden_layers": 3})
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        attn_logit_softcapping=1.0, final_logit_softcapping=3.0, **gemma)  # fmt: skip
        cfg._attn_implementation = "eager"
        return cfg
    if arch == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}  # fmt: skip
        cfg = transformers.Gemma3TextConfig(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                            rope_parameters=rope, **gemma)  # fmt: skip
        cfg.architectures = ["Gemma3ForCausalLM"]
        cfg._attn_implementation = "eager"
        return cfg
    if arch == "llama3":  # Llama with llama3 RoPE scaling and tied embeddings
        common.update(tie_word_embeddings=True, num_key_value_heads=1)
        return transformers.LlamaConfig(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
            **common,
        )
    raise ValueError(arch)


TINY_ARCHS = [
    "qwen3",
    "qwen2",
    "mistral",
    "mistral_window",
    "llama3",
    "mixtral",
    "qwen2moe",
    "qwen3moe",
    "deepseek_v2",
    "deepseek_v3",
    "gemma2",
    "gemma3",
]


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny_model(request, tmp_path_factory):
    """A random-weight model saved as safetensors, HF's greedy outputs, and our loaded model."""
    import transformers

    torch.manual_seed(0)
    cfg = _tiny_config(request.param)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    for layer in hf.model.layers:
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0, 0.3)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    prompts_ids = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 17, 40, 33)]
    prompts_ids.append(prompts_ids[2][:32] + [7, 8, 9])  # shares two 16-token blocks with prompt 2
    expected = [hf_greedy(hf, ids, MAX_TOKENS) for ids in prompts_ids]
    loaded = load_model(EngineArgs(model=str(path), device="cpu", dtype="float32"))
    return loaded, prompts_ids, expected


def test_moe_configs_build_the_sparse_layers_hf_has(tiny_model):
    """The tiny MoE configs exercise what they claim: sparse layers where HF has them, experts packed."""
    from ferry.layers.moe import FusedMoE
    from ferry.models.llama import SparseMoeBlock

    loaded = tiny_model[0]
    cfg = loaded.model.config
    sparse = [i for i, layer in enumerate(loaded.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == list(cfg.moe_layers)
    expected = {"MixtralForCausalLM": [0, 1], "Qwen2MoeForCausalLM": [0, 1], "Qwen3MoeForCausalLM": [0],
                "DeepseekV2ForCausalLM": [1], "DeepseekV3ForCausalLM": [1]}  # fmt: skip
    assert sparse == expected.get(cfg.architecture, [])
    for i in sparse:
        block = loaded.model.layers[i].mlp
        assert isinstance(block.experts, FusedMoE) and block.experts.packed13 is not None  # oneDNN on the CPU
        assert (block.shared_expert is not None) == (cfg.architecture in ("Qwen2MoeForCausalLM", *DEEPSEEK))
        assert (block.shared_expert_gate is not None) == (cfg.architecture == "Qwen2MoeForCausalLM")


DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def test_kv_cache_rows_per_architecture(tiny_model):
    """The DeepSeek configs run latent attention: one row of latent + rotary key per token and layer
    (40 values, against 4 heads x (24 + 16) expanded), counted so by the KV budget; the others a K and
    a V row per KV head."""
    from ferry.layers.mla import MLAAttention
    from ferry.worker.memory import kv_bytes_per_token

    loaded = tiny_model[0]
    cfg = loaded.model.config
    mla = cfg.architecture in DEEPSEEK
    assert cfg.is_mla == mla
    assert all(isinstance(layer.self_attn, MLAAttention) == mla for layer in loaded.model.layers)
    k, v = _tiny_engine(loaded).runner.kv_caches[0]
    if mla:
        assert k is v and tuple(k.shape) == (64, 16, 1, 40)
        assert kv_bytes_per_token(cfg, torch.float32) == cfg.num_hidden_layers * 40 * 4
    else:
        kvh, d = cfg.num_key_value_heads, cfg.head_dim
        assert k is not v and tuple(k.shape) == tuple(v.shape) == (64, 16, kvh, d)
        assert kv_bytes_per_token(cfg, torch.float32) == cfg.num_hidden_layers * 2 * kvh * d * 4


def _tiny_engine(loaded, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_kv_blocks", 64)
    return engine_over(loaded, **kwargs)


def test_tiny_models_match_hf(tiny_model):
    loaded, prompts_ids, expected = tiny_model
    one = _tiny_engine(loaded)
    assert [ferry_greedy(one, [ids], MAX_TOKENS)[0] for ids in prompts_ids] == expected
    batched = _tiny_engine(loaded)
    assert ferry_greedy(batched, prompts_ids, MAX_TOKENS) == expected
    # Warm cache: the same prompts again hit their full blocks.
    assert ferry_greedy(batched, prompts_ids, MAX_TOKENS) == expected
    assert batched.get_stats().prefix_cache_hits > 0
    chunked = _tiny_engine(loaded, max_num_batched_tokens=5)
    assert ferry_greedy(chunked, prompts_ids, MAX_TOKENS) == expected
    longest = max(len(p) for p in prompts_ids) + MAX_TOKENS
    small = _tiny_engine(loaded, block_size=4, num_kv_blocks=longest // 4 + 8, max_model_len=longest + 4)
    assert ferry_greedy(small, prompts_ids, MAX_TOKENS) == expected
    assert small.get_stats().num_preemptions > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_models_match_hf_on_cuda(tiny_model):
    """The same engine on CUDA (reference attention, fp32) reproduces HF's greedy tokens."""
    (_, _, _, _, path), prompts_ids, expected = tiny_model
    model, tokenizer, device, dtype, _ = load_model(EngineArgs(model=path, device="cuda", dtype="float32"))
    engine = LLMEngine(
        EngineArgs(model=path, device="cuda", dtype="float32", num_kv_blocks=64),
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
    )
    assert ferry_greedy(engine, prompts_ids, MAX_TOKENS) == expected


# ---------------------------------------------------------------- sliding window


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A Mistral with an 8-token window, HF's greedy tokens for prompts far longer than it, and the
    same weights' greedy tokens without the window (HF), to show the window changes them."""
    import transformers

    torch.manual_seed(0)
    cfg = _tiny_config("mistral")
    cfg.sliding_window = 8
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("mistral-window8")
    hf.save_pretrained(path)
    g = torch.Generator().manual_seed(3)
    prompts_ids = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (150, 61)]
    expected = [hf_greedy(hf, ids, MAX_TOKENS) for ids in prompts_ids]
    hf.config.sliding_window = None
    for layer in hf.model.layers:
        layer.self_attn.sliding_window = None
    full = [hf_greedy(hf, ids, MAX_TOKENS) for ids in prompts_ids]
    return load_model(EngineArgs(model=str(path), device="cpu", dtype="float32")), prompts_ids, expected, full


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sliding_window_frees_blocks_and_matches_hf(windowed, backend):
    """A 150-token prompt and 24 more tokens in a cache of 12 four-token blocks (48 tokens): the blocks
    that fall out of the 8-token window are released as the request runs, so it never holds more
    than the window and a step's chunk, and max_model_len is not capped to the cache or the window.
    The Triton kernels never read the released blocks' stand-in (they start at the window)."""
    loaded, prompts_ids, expected, full = windowed
    assert expected[0] != full[0]  # the window changes the continuation: not a vacuous match
    engine = _tiny_engine(loaded, block_size=4, num_kv_blocks=12, max_num_batched_tokens=8, attention_backend=backend)
    assert engine.max_model_len == 512
    kv = engine.kv
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": prompts_ids[0]}, params)
    held, done = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        held.append(kv.num_blocks_held("long"))
        assert kv.pool.num_referenced() == held[-1]
    # 8 tokens of window before the chunk, 8 chunk tokens, partial blocks at both ends: <= 5 blocks.
    assert max(held[:-1]) <= 5 and len(held) > 150 // 8
    assert done["long"].outputs[0].token_ids == expected[0]
    assert_no_blocks_referenced(engine)


def test_sliding_window_with_prefix_cache_and_preemption(windowed):
    loaded, prompts_ids, expected, _ = windowed
    engine = _tiny_engine(loaded, block_size=4, num_kv_blocks=7, max_num_batched_tokens=8)
    assert ferry_greedy(engine, prompts_ids, MAX_TOKENS) == expected  # two requests of up to 5 blocks in 7
    assert engine.get_stats().num_preemptions > 0
    # The same prompts again: their cached blocks (released out of the window, still cached) hit or are
    # recomputed; the output cannot change either way.
    warm = _tiny_engine(loaded, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    ferry_greedy(warm, prompts_ids[1:], MAX_TOKENS)
    hits = warm.get_stats().prefix_cache_hits
    assert ferry_greedy(warm, prompts_ids, MAX_TOKENS) == expected
    assert warm.get_stats().prefix_cache_hits > hits


def test_local_global_window_mix_runs_past_the_window(tmp_path):
    """Qwen2 windows only the layers from max_window_layers on: the windowed layer attends to its last
    16 positions and the global one to everything, per layer; the context is not capped to the window,
    no block is released (the global layer reads them all), and prompts far past the window give HF's
    tokens, on the torch and the Triton backend."""
    import transformers

    torch.manual_seed(0)
    window = {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1, "layer_types": None}
    cfg = transformers.Qwen2Config(**{**_tiny_config("qwen2").to_dict(), **window})
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    hf.save_pretrained(tmp_path)
    loaded = load_model(EngineArgs(model=str(tmp_path), device="cpu", dtype="float32"))
    assert loaded.model.config.full_attention_layers == (0,)
    assert [layer.self_attn.window for layer in loaded.model.layers] == [None, 16]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 21)]
    expected = [hf_greedy(hf, ids, 12) for ids in prompts]
    for backend in ("torch", "triton"):
        engine = _tiny_engine(
            loaded, attention_backend=backend, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16
        )
        assert engine.max_model_len == 512 and engine.kv.sliding_window is None
        assert ferry_greedy(engine, prompts, 12) == expected


# ---------------------------------------------------------------- Gemma


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_tiny_config("gemma2"), dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("gemma2")
    hf.save_pretrained(path)
    return hf, load_model(EngineArgs(model=str(path), device="cpu", dtype="float32"))


def test_gemma2_logprobs_are_the_soft_capped_logits(gemma2):
    """The final soft cap does not move the argmax; the logprobs show it: each prompt's first token's
    top 5 equal HF's log-softmax of its capped logits (and not of the uncapped ones)."""
    hf, loaded = gemma2
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (6, 23)]
    engine = _tiny_engine(loaded)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    done = run_to_completion(engine)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        got = done[str(i)].outputs[0].logprobs[0]
        for token, lp in got.items():
            assert abs(lp.logprob - ref[token].item()) < 1e-4
    assert ref.exp().max() < 0.9 and ref.max() - ref.min() <= 6.0 + 1e-4  # logits in [-3, 3]: the cap held


def test_gemma2_on_the_triton_backend_matches_hf(gemma2):
    """Local and global layers with soft-capped scores in the Triton kernels (interpreted on the CPU):
    decode and prefill chunks past the window, HF's greedy tokens."""
    hf, loaded = gemma2
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (23, 9)]
    expected = [hf_greedy(hf, ids, 10) for ids in prompts]
    engine = _tiny_engine(loaded, attention_backend="triton", block_size=4, max_num_batched_tokens=12)
    assert engine.runner.attn_backend.name == "triton"
    assert ferry_greedy(engine, prompts, 10) == expected


# ---------------------------------------------------------------- MLA on the Triton backend


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_deepseek_v3_on_the_triton_backend_matches_the_torch_backend(tmp_path, kv_cache_dtype):
    """Latent attention through the Triton backend (interpreted on the CPU): rows stored by its store
    kernel, decode in the absorbed form (kernels/triton_mla.py), prefill chunks behind a cached prefix
    expanded over their contexts. fp32: HF's greedy tokens; an int8 cache: the torch backend's."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_tiny_config("deepseek_v3"), dtype=torch.float32).eval()
    for layer in hf.model.layers:
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    loaded = load_model(EngineArgs(model=str(tmp_path), device="cpu", dtype="float32"))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (21, 6)]
    prompts.append(prompts[0][:16] + [3, 4, 5])  # its first 16 tokens cached: a chunk behind a prefix
    kwargs = dict(block_size=4, max_num_batched_tokens=12, kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype == "auto":
        expected = [hf_greedy(hf, ids, 8) for ids in prompts]
    else:
        expected = ferry_greedy(_tiny_engine(loaded, **kwargs), prompts, 8)
    engine = _tiny_engine(loaded, attention_backend="triton", **kwargs)
    assert engine.runner.attn_backend.name == "triton"
    assert ferry_greedy(engine, prompts, 8) == expected
    assert engine.get_stats().prefix_cache_hits > 0


@pytest.mark.parametrize("path", ["chunk by chunk", "groups of 12 rows"])
def test_deepseek_expanded_prefill_paths_match_hf(tmp_path, monkeypatch, path):
    """MLA's prefill chunks attend all at once over their laid-out contexts (layers/attention/contexts.py)
    where the backend can (the C++ prefill kernel here, fp32); the other two paths give HF's tokens
    too: chunk by chunk through SDPA (a backend without such a kernel), and the layout split into
    groups of at most 12 rows (three blocks of 4), so a step makes several calls and a chunk longer
    than that is a group of its own."""
    import transformers

    from ferry.layers.attention import contexts, torch_backend

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_tiny_config("deepseek_v2"), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    loaded = load_model(EngineArgs(model=str(tmp_path), device="cpu", dtype="float32"))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 21, 6, 13)]
    prompts.append(prompts[1][:16] + [3, 4, 5])  # its first 16 tokens cached: a chunk behind a prefix
    expected = [hf_greedy(hf, ids, 8) for ids in prompts]
    calls = []
    if path == "chunk by chunk":
        monkeypatch.setattr(torch_backend.TorchAttentionBackend, "attends_contexts", lambda self, dtype: False)
    else:
        monkeypatch.setattr(contexts, "EXPANDED_GROUP_ROWS", 12)
        real = torch_backend.TorchAttentionBackend.attend_contexts
        monkeypatch.setattr(torch_backend.TorchAttentionBackend, "attend_contexts",
                            lambda self, *a: calls.append(a[3].tables.shape[0]) or real(self, *a))  # fmt: skip
    engine = _tiny_engine(loaded, block_size=4, max_num_batched_tokens=12)
    assert ferry_greedy(engine, prompts, 8) == expected
    assert engine.get_stats().prefix_cache_hits > 0
    if path != "chunk by chunk":  # several calls a layer, some of one chunk, some of two
        assert calls and set(calls) == {1, 2}, calls
