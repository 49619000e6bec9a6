"""`--load-format dummy`: shipped configs, random weights, and an engine without a tokenizer."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.models.config import ModelConfig
from ferry.models.dummy_weights import iter_dummy_weights, weight_shapes
from ferry.models.llama import LlamaForCausalLM
from ferry.models.loader import load_checkpoint
from ferry.models.paths import resolve_model_path, shipped_config_names
from ferry.tokenizer import load_tokenizer

TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# name -> (architecture, layers, heads, kv heads, head_dim, hidden, vocab, tied, parameters)
SHIPPED = {
    "qwen3-0.6b": ("Qwen3ForCausalLM", 28, 16, 8, 128, 1024, 151936, True, 596_049_920),
    "llama-3.1-8b": ("LlamaForCausalLM", 32, 32, 8, 128, 4096, 128256, False, 8_030_261_248),
    "qwen2.5-7b": ("Qwen2ForCausalLM", 28, 28, 4, 128, 3584, 152064, False, 7_615_616_512),
    # 30.5B parameters, as Qwen's model card says; 128 experts of 768, 8 per token, in all 48 layers.
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", 48, 32, 4, 128, 2048, 151936, False, 30_532_122_624),
    # 15.7B, as DeepSeek's card says: MLA (head_dim is the 64-wide rotary key; the latent is one row, so
    # kv heads = heads), 64 experts of 1408, 6 per token, plus 2 shared, in layers 1-26.
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", 27, 16, 16, 64, 2048, 102400, False, 15_706_484_224),
}


def write_config(directory, **overrides) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**TINY_CONFIG, **overrides}, f)
    return str(directory)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("tiny-dummy"))


def tiny_llm(path: str, **kwargs) -> LLM:
    kwargs = {"load_format": "dummy", "device": "cpu", "num_kv_blocks": 32, **kwargs}
    return LLM(path, **kwargs)


PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [200, 17, 99]}]


def greedy(llm: LLM, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **kwargs)
    return llm.generate(PROMPTS, params, use_tqdm=False)


def test_shipped_configs_parse():
    assert set(SHIPPED) <= set(shipped_config_names())
    for name, (arch, layers, heads, kv_heads, head_dim, hidden, vocab, tied, _) in SHIPPED.items():
        cfg = load_checkpoint(name, "dummy").config
        got = (cfg.architecture, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
        assert got == (arch, layers, heads, kv_heads), name
        got = (cfg.head_dim, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings)
        assert got == (head_dim, hidden, vocab, tied), name
        assert cfg.dtype == "bfloat16" and cfg.sliding_window is None
    llama = load_checkpoint("llama-3.1-8b", "dummy").config
    assert llama.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert llama.rope_theta == 500000.0 and llama.eos_token_ids == [128001, 128008, 128009]
    assert load_checkpoint("qwen2.5-7b", "dummy").config.attention_bias  # Qwen2's q/k/v biases
    assert load_checkpoint("qwen3-0.6b", "dummy").config.qk_norm
    moe = load_checkpoint("qwen3-30b-a3b", "dummy").config
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert moe.moe_layers == tuple(range(48)) and moe.norm_topk_prob and moe.qk_norm
    lite = load_checkpoint("deepseek-v2-lite", "dummy").config
    assert (lite.kv_lora_rank, lite.q_lora_rank, lite.qk_nope_head_dim, lite.v_head_dim) == (512, 0, 128, 128)
    assert lite.kv_cache_width == 576 and lite.rope_interleave and lite.rope_scaling["rope_type"] == "yarn"
    assert lite.moe_layers == tuple(range(1, 27)) and lite.shared_expert_intermediate_size == 2 * 1408
    routing = (lite.moe_scoring, lite.moe_n_group, lite.routed_scaling_factor, lite.norm_topk_prob)
    assert routing == ("softmax", 1, 1.0, False)


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_parameter_counts_on_meta(name):
    cfg = load_checkpoint(name, "dummy").config
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_position=4096)
    count = sum(p.numel() for p in model.parameters())
    assert count == SHIPPED[name][-1]
    assert count == sum(math.prod(shape) for _, shape in weight_shapes(cfg))


def test_shipped_name_needs_dummy_and_unknown_names_list_them(tmp_path):
    with pytest.raises(ValueError, match="--load-format dummy"):
        load_checkpoint("qwen3-0.6b")
    with pytest.raises(FileNotFoundError, match=re.escape("llama-3.1-8b, qwen2.5-7b, qwen3-0.6b")):
        resolve_model_path("no-such-model", "dummy")
    # A config-only directory: weights needed unless dummy.
    config_only = write_config(tmp_path / "cfg")
    with pytest.raises(ValueError, match="--load-format dummy"):
        load_checkpoint(config_only)
    assert load_checkpoint(config_only, "dummy").format == "dummy"
    assert load_tokenizer(config_only) is None


def test_dummy_weights_are_seeded_per_tensor():
    cfg = ModelConfig.from_hf_dict(TINY_CONFIG)
    a = dict(iter_dummy_weights(cfg, seed=1))
    b = dict(iter_dummy_weights(cfg, seed=1))
    c = dict(iter_dummy_weights(cfg, seed=2))
    assert a.keys() == b.keys() == {n for n, _ in weight_shapes(cfg)}
    assert all(torch.equal(a[n], b[n]) for n in a)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[w], c[w])
    assert abs(a[w].std().item() - 0.02) < 0.002
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    # Layer 0 does not depend on how many layers follow it.
    deeper = dict(iter_dummy_weights(ModelConfig.from_hf_dict({**TINY_CONFIG, "num_hidden_layers": 3}), seed=1))
    assert torch.equal(a[w], deeper[w])


def test_generate_on_token_ids_is_deterministic_per_seed(tiny_dir):
    first = tiny_llm(tiny_dir, seed=3)
    out1 = greedy(first)
    out2 = greedy(tiny_llm(tiny_dir, seed=3))
    other = tiny_llm(tiny_dir, seed=4)
    for a, b in zip(out1, out2):
        assert len(a.outputs[0].token_ids) == 8 and a.outputs[0].text == ""
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_token_ids == b.prompt_token_ids
    w1 = first.llm_engine.model.embed_tokens.weight
    w2 = other.llm_engine.model.embed_tokens.weight
    assert not torch.equal(w1, w2)
    assert first.get_tokenizer() is None


def test_max_model_len_past_the_context_needs_the_override(tiny_dir, monkeypatch):
    monkeypatch.delenv("FERRY_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match="max_model_len 512 is longer than the model's context, 256 tokens"):
        tiny_llm(tiny_dir, max_model_len=512)
    assert tiny_llm(tiny_dir).llm_engine.info.max_model_len == 256  # the default: the model's context
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert tiny_llm(tiny_dir, max_model_len=512).llm_engine.info.max_model_len == 512


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_are_finite(tiny_dir, dtype):
    llm = tiny_llm(tiny_dir, dtype=dtype)
    model = llm.llm_engine.model
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for out in greedy(llm, logprobs=5):
        for entry in out.outputs[0].logprobs:
            assert len(entry) >= 5 and all(math.isfinite(lp.logprob) for lp in entry.values())


def test_text_prompt_without_tokenizer_is_a_clear_error(tiny_dir):
    llm = tiny_llm(tiny_dir)
    with pytest.raises(ValueError, match=r"no tokenizer \(--load-format dummy.*send token ids"):
        llm.generate(["hello", PROMPTS[0]], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate(PROMPTS[0], SamplingParams(stop=["x"]), use_tqdm=False)


def test_cli_generate_prints_token_ids(tiny_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "ferry.cli", "generate", "--model", tiny_dir, "--load-format", "dummy",
         "--prompt-token-ids", "1,2,3,4,5", "--max-tokens", "8", "--device", "cpu", "--num-kv-blocks", "32",
         "--seed", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    expected = greedy(tiny_llm(tiny_dir, seed=3))[0].outputs[0].token_ids
    assert [int(t) for t in proc.stdout.split()] == expected


def test_sampling_defaults_come_from_the_generation_config(tmp_path):
    from ferry.models.generation_config import sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "do_sample": True,
         "min_p": "x", "eos_token_id": [1, 2], "max_new_tokens": 100.0}))  # fmt: skip
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 100}
    assert sampling_defaults(str(tmp_path)) == want
    assert sampling_defaults(str(tmp_path), "vllm") == {}
    assert sampling_defaults("/nowhere/model.gguf", str(tmp_path)) == want  # a directory of one's own
    assert sampling_defaults(str(tmp_path / "none")) == {}
    # vLLM's --override-generation-config: fields set over the file's, or over none
    over = sampling_defaults(str(tmp_path), "auto", {"temperature": 0.2, "max_new_tokens": 5})
    assert over == {**want, "temperature": 0.2, "max_tokens": 5}
    assert sampling_defaults(str(tmp_path), "vllm", {"top_k": 3}) == {"top_k": 3}
    with pytest.raises(ValueError, match="'do_sample' not read"):
        sampling_defaults(str(tmp_path), "auto", {"do_sample": True})
    with pytest.raises(ValueError, match="top_p must be a finite number"):
        sampling_defaults(str(tmp_path), "auto", {"top_p": "high"})
    with pytest.raises(ValueError, match="auto, vllm or a directory"):
        sampling_defaults(str(tmp_path), "greedy")
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON generation config"):
        sampling_defaults(str(tmp_path))


def test_a_generation_config_out_of_range_stops_serve_at_once(tiny_dir, tmp_path):
    import shutil

    model_dir = shutil.copytree(tiny_dir, tmp_path / "tiny")
    (model_dir / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    proc = subprocess.run([sys.executable, "-m", "ferry.cli", "serve", str(model_dir), "--load-format", "dummy",
                           "--port", "1"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "generation_config.json" in proc.stderr and "top_p" in proc.stderr and "Traceback" not in proc.stderr
    # ... and so does an override out of range, over a file in range
    (model_dir / "generation_config.json").write_text(json.dumps({"top_p": 0.9}))
    proc = subprocess.run([sys.executable, "-m", "ferry.cli", "serve", str(model_dir), "--load-format", "dummy",
                           "--override-generation-config", '{"top_p": 0}', "--port", "1"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "top_p" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_cli_errors_without_tokenizer_or_weights(tiny_dir, capsys):
    from ferry.cli import main

    # A text prompt to a model without a tokenizer, a shipped name without --load-format dummy.
    for args, word in ((["hello", "--model", tiny_dir, "--load-format", "dummy"], "send token ids"),
                       (["--prompt-token-ids", "1", "--model", "qwen3-0.6b"], "--load-format dummy"),
                       (["--prompt-token-ids", "1,x", "--model", tiny_dir], "--prompt-token-ids must be")):  # fmt: skip
        assert main(["generate", *args, "--device", "cpu", "--num-kv-blocks", "32"]) == 2
        err = capsys.readouterr().err
        assert word in err and "Traceback" not in err, err


def test_serve_token_ids_without_tokenizer(tiny_dir, tmp_path):
    import shutil

    import httpx
    from server_utils import ServerProcess

    # The checkpoint's generation_config.json sets the sampling defaults (vLLM's --generation-config auto):
    # greedy here, so a request that names no temperature decodes greedily.
    model_dir = shutil.copytree(tiny_dir, tmp_path / "tiny")
    (model_dir / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_p": 0.9, "do_sample": False, "max_new_tokens": 8})
    )
    s = ServerProcess(str(model_dir), "--load-format", "dummy", "--device", "cpu", "--num-kv-blocks", "32",
                      "--served-model-name", "tiny", "--seed", "3")  # fmt: skip
    try:
        expected = greedy(tiny_llm(tiny_dir, seed=3))
        body = {"model": "tiny", "prompt": [p["prompt_token_ids"] for p in PROMPTS], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["token_ids"] for c in choices] == [o.outputs[0].token_ids for o in expected]
        assert [c["prompt_token_ids"] for c in choices] == [p["prompt_token_ids"] for p in PROMPTS]
        assert all(c["text"] == "" for c in choices)
        unset = {k: v for k, v in body.items() if k != "temperature"}  # the model's default: greedy
        r = httpx.post(s.url + "/v1/completions", json=unset, timeout=60)
        assert [c["token_ids"] for c in r.json()["choices"]] == [o.outputs[0].token_ids for o in expected]
        # max_new_tokens (8) caps a request that names none, or more (vLLM's get_max_tokens: the smallest)
        named_none = {k: v for k, v in unset.items() if k != "max_tokens"}
        for limit in ({}, {"max_tokens": None}, {"max_tokens": 20}):  # {}: OpenAI's default, 16
            r = httpx.post(s.url + "/v1/completions", json=named_none | limit, timeout=60)
            assert [c["token_ids"] for c in r.json()["choices"]] == [o.outputs[0].token_ids for o in expected], limit
        # ... and is shortened to the room left in the context (256 tokens): a 400 only for the client's own
        long = {**unset, "prompt": [1] * 253, "max_tokens": None}
        r = httpx.post(s.url + "/v1/completions", json=long, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3, r.text
        for prompt, asked in ((253, 4), (253, 20), (240, 20)):  # the client's own against the room (3, 3, 16),
            # though max_new_tokens caps 20 to 8, which 240 tokens leave room for
            r = httpx.post(s.url + "/v1/completions", json={**long, "prompt": [1] * prompt, "max_tokens": asked},
                           timeout=60)  # fmt: skip
            assert r.status_code == 400 and f"({prompt} in the prompt, {asked} in the completion)" in r.text, r.text
        defaults = tiny_llm(str(model_dir), seed=3).get_default_sampling_params()  # LLM.generate's, as vLLM's
        assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.0, 0.9, 8)
        # Streamed: the prompt's ids once, then the new ids chunk by chunk.
        streamed, prompt_ids = [], None
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "prompt": PROMPTS[0]["prompt_token_ids"],
                          "stream": True}, timeout=60) as resp:  # fmt: skip
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        prompt_ids = c.get("prompt_token_ids", prompt_ids)
                        streamed += c["token_ids"]
        assert streamed == expected[0].outputs[0].token_ids and prompt_ids == PROMPTS[0]["prompt_token_ids"]
        r = httpx.post(s.url + "/v1/completions", json={**body, "prompt": "hello"}, timeout=60)
        assert r.status_code == 400 and "send token ids" in r.json()["error"]["message"], r.text
        r = httpx.post(s.url + "/v1/chat/completions",
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)  # fmt: skip
        assert r.status_code == 400, r.text
    finally:
        assert s.stop() == 0, s.logs()
