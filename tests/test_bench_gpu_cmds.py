"""The GPU benchmark commands at toy sizes on the CPU: `ferry bench latency` and
`ferry bench throughput --dataset sharegpt-like`, on a tiny config with random weights."""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

from ferry.bench.hardware import known_peak_bandwidth
from ferry.bench.latency import cache_sized_for, weight_bytes_per_step
from ferry.bench.synthetic import SHAREGPT_LIKE_CLIP, sharegpt_like_requests
from ferry.cli import main
from ferry.models.config import ModelConfig
from ferry.worker.memory import kv_bytes_per_token

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 160,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-bench")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(TINY, f)
    return str(d)


ENGINE = ["--load-format", "dummy", "--device", "cpu", "--num-kv-blocks", "64", "--max-num-batched-tokens", "256"]


def test_bench_latency(tiny_dir, tmp_path, capsys):
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--model", tiny_dir, "--batch-sizes", "1", "4", "--input-len", "16", "--output-len",
            "6", "--warmup-steps", "1", "--peak-bandwidth", "1e11", "--json", str(out), *ENGINE]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "B=   1: TPOT" in printed and "B=   4: TPOT" in printed and "% of peak" in printed
    result = json.loads(out.read_text())
    assert result["device_name"] and result["peak_bandwidth"] == 1e11
    assert [b["batch_size"] for b in result["batches"]] == [1, 4]
    for b in result["batches"]:
        assert b["decode_steps"] == 5  # output 6 tokens: the first comes from the prefill step
        for key in ("tpot_ms", "output_tok_per_s", "weight_bytes_per_step", "kv_bytes_per_step",
                    "bandwidth_bytes_per_s", "bandwidth_fraction", "prefill_tok_per_s"):  # fmt: skip
            assert b[key] > 0, key
    # Without a peak on the CPU: its read bandwidth, measured (the step's bytes floor).
    argv = [a for a in argv if a not in ("--peak-bandwidth", "1e11")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "x the bytes floor" in printed and "x at the step's own" in printed
    result = json.loads(out.read_text())
    assert result["peak_bandwidth_source"].startswith("measured") and result["peak_bandwidth"] is None
    for b in result["batches"]:  # measured around each batch size's steps; the floor takes the faster read
        before, after = b["measured_bandwidth_before_after"]
        assert min(before, after) > 1e8 and b["peak_bandwidth"] == max(before, after)
        assert b["bandwidth_fraction"] == pytest.approx(b["bandwidth_bytes_per_s"] / b["peak_bandwidth"])
        # and over a buffer of the step's own bytes (here a tiny model's: cache-resident), its floor too
        own = b["measured_bandwidth_at_step_size"]
        assert own > 1e8 and b["x_floor_at_step_size"] == pytest.approx(own / b["bandwidth_bytes_per_s"])


def test_bench_latency_int4_dummy_weights_counts_the_blocks(tiny_dir, tmp_path):
    """`--quantization gguf` on dummy weights (random Q4_0 projections, as the GPU session measures an
    8B-shaped int4 model): the bandwidth figure counts the blocks' bytes, not the float weights'."""
    out = tmp_path / "int4.json"
    argv = ["bench", "latency", "--model", tiny_dir, "--batch-sizes", "1", "--input-len", "16", "--output-len", "4",
            "--warmup-steps", "0", "--quantization", "gguf", "--json", str(out), *ENGINE]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["engine_args"]["quantization"] == "gguf"
    h, d, layers = 64, 16, 2
    projections = layers * (h * 4 * d + 2 * h * 2 * d + 4 * d * h + 3 * h * 128)  # q, k, v, o, gate, up, down
    floats = 4 * (layers * 2 * h + h + 512 * h + h)  # fp32 norms, the tied head in full, one embedding row
    assert result["batches"][0]["weight_bytes_per_step"] == projections * 18 // 32 + floats
    held = result["weight_bytes_held"]  # what the model holds: the blocks, and no float copy beside them;
    assert held["projections"] == projections * 18 // 32  # the tied fp32 table for lookups, its packed copy
    assert held["embedding"] == held["head"] == 4 * 512 * h  # for the head


def test_bench_throughput_sharegpt_like_with_hf_reference(tiny_dir, tmp_path, capsys):
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", tiny_dir, "--dataset", "sharegpt-like", "--num-prompts", "6",
            "--hf-num-prompts", "2", "--hf-batch-size", "2", "--json", str(out), *ENGINE]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "mean prompt" in printed and "ferry / HF output tok/s" in printed
    result = json.loads(out.read_text())
    assert result["device_name"] and result["load_format"] == "dummy"
    w = result["workload"]
    assert w["dataset"] == "sharegpt-like" and w["num_prompts"] == 6
    assert w["mean_prompt_tokens"] > 0 and w["mean_output_tokens"] > 0
    assert result["ferry"]["tokens_per_s"] > 0 and result["ferry"]["output_tokens"] == w["output_tokens"]
    assert result["hf"]["num_prompts"] == 2 and result["hf"]["tokens_per_s"] > 0 and result["ratio"] > 0


def test_two_engine_benches_size_their_caches_to_their_runs():
    """Two engines over one model on a GPU: the second's memory profile counts the first's cache, so
    each bench engine gets the blocks its runs need instead of a share of the device."""
    from ferry.config import EngineArgs

    sized = cache_sized_for(EngineArgs(block_size=16), num_seqs=4, tokens_per_seq=100)
    assert sized.num_kv_blocks == 4 * 7 + 16  # 100 tokens fill 7 blocks of 16
    assert cache_sized_for(EngineArgs(num_kv_blocks=9), 4, 100).num_kv_blocks == 9  # the user's choice stands
    by_memory = EngineArgs(kv_cache_memory_bytes=1 << 20)
    assert cache_sized_for(by_memory, 4, 100) == by_memory
    long_context = cache_sized_for(EngineArgs(block_size=16, max_model_len=8192), 4, 100)
    assert long_context.num_kv_blocks == 8192 // 16  # the engine refuses a max_model_len its cache cannot hold


def test_bench_throughput_torch_profile_windows(tiny_dir, tmp_path, capsys):
    """--torch-profile: a window of steps that all carry prompt tokens (24 queued prompts, 256-token
    steps), then one that only decodes, each with its operators, and no timed run."""
    out = tmp_path / "prof.json"
    argv = ["bench", "throughput", "--model", tiny_dir, "--dataset", "sharegpt-like", "--num-prompts", "24",
            "--no-hf", "--torch-profile", "2", "--json", str(out), *ENGINE]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "steps with prefill: 2 steps" in printed and "decode-only steps: 2 steps" in printed
    prof = json.loads(out.read_text())["torch_profile"]
    assert prof["prefill_steps"]["prompt_tokens_per_step"] > 0 and prof["decode_steps"]["prompt_tokens_per_step"] == 0
    for window in prof.values():
        assert window["steps"] == 2 and window["top"] and window["time_key"] == "self_cpu_time_total"
        assert all(r["ms_per_step"] > 0 and r["calls_per_step"] > 0 for r in window["top"])
    assert "ferry:" not in printed  # no timed run beside the profile
    for bad in (["--torch-profile", "0"], ["--torch-profile", "2", "--prefix"]):  # refused before loading
        assert main(["bench", "throughput", "--model", tiny_dir, *bad, *ENGINE]) == 2
        assert "--torch-profile" in capsys.readouterr().err


def test_sharegpt_like_lengths():
    reqs = sharegpt_like_requests(1000, 32000, seed=0)
    plens, olens = [len(p) for p, _ in reqs], [n for _, n in reqs]
    assert 180 < statistics.fmean(plens) < 220 and 160 < statistics.fmean(olens) < 200
    lo, hi = SHAREGPT_LIKE_CLIP
    assert min(plens + olens) >= lo and max(plens + olens) <= hi
    assert reqs == sharegpt_like_requests(1000, 32000, seed=0)


def test_bytes_per_decode_step():
    cfg = ModelConfig.from_hf_dict(TINY)
    h, v, layers, kvh, d = 64, 512, 2, 2, 16
    per_layer = h * (4 * d) + 2 * h * (kvh * d) + (4 * d) * h + 3 * h * 128 + 2 * h
    # bf16: the tied head read in full, plus the B embedding rows gathered, plus the final norm.
    expected = 2 * (layers * per_layer + v * h + 8 * h + h)
    assert weight_bytes_per_step(cfg, torch.bfloat16, 8) == expected
    assert kv_bytes_per_token(cfg, torch.bfloat16) == layers * 2 * kvh * d * 2


def test_known_gpu_bandwidths():
    assert known_peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert known_peak_bandwidth("NVIDIA H200") == 4.8e12
    assert known_peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert known_peak_bandwidth("x86_64") is None


def test_hf_reference_runs_the_same_dummy_weights(tmp_path):
    from ferry import LLM, SamplingParams
    from ferry.bench.hf_baseline import load_hf_model

    config = {**TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=32, seed=5)
    ids = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
    hf = load_hf_model(str(tmp_path), torch.float32, "cpu", dummy_config=llm.llm_engine.model_config, seed=5)
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids) :].tolist()
    assert ours == theirs and len(set(ours)) > 1


@pytest.mark.parametrize("quant", [[], ["--quantization", "gguf"]], ids=["float", "gguf"])
def test_bench_moe_against_its_dense_twin(tmp_path, capsys, quant):
    """Both models in the model dtype, or both with Q4_0 projections and experts (the CPU kernels)."""
    out = tmp_path / "moe.json"
    argv = ["bench", "moe", "--hidden-size", "64", "--layers", "2", "--experts", "8", "--top-k", "2",
            "--moe-intermediate-size", "32", "--batch-sizes", "1", "8", "--input-len", "8", "--output-len", "5",
            "--json", str(out), *quant]  # fmt: skip
    assert main(argv) == 0
    assert "vs dense twin" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["batch_size"] for r in rows] == [1, 8]
    for r in rows:
        moe, dense = r["moe"], r["dense"]
        # The twin has the same parameters per token, the routers (experts x hidden per layer) aside.
        assert moe["params_active"] - dense["params_active"] == 2 * 8 * 64
        assert moe["params_total"] > dense["params_total"] and moe["decode_steps"] == dense["decode_steps"] == 4
        assert r["tpot_ratio"] == pytest.approx(moe["tpot_ms"] / dense["tpot_ms"])
        assert moe["prefill_tok_per_s"] > 0 and dense["prefill_tok_per_s"] > 0
    assert rows[0]["moe"]["experts_touched_per_layer"] == 2  # one token: exactly its top-2
    assert 2 < rows[1]["moe"]["experts_touched_per_layer"] <= 8


def test_moe_bytes_per_step_count_the_experts_a_batch_can_touch():
    moe = ModelConfig.from_hf_dict({**TINY, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                    "num_experts_per_tok": 2})  # fmt: skip
    one, four, many = (weight_bytes_per_step(moe, torch.float32, b) for b in (1, 4, 64))
    expert_bytes = 3 * 64 * 128 * 4  # gate, up, down of one expert in one layer
    # 8 experts touched, not 2: six more in each of the two layers, and three more embedding rows.
    assert four - one == 6 * 2 * expert_bytes + 3 * 64 * 4
    assert many - four == 60 * 64 * 4  # all 8 experts touched either way: only the embedding rows grow


def test_bench_mla_against_its_gqa_twin(tmp_path, capsys):
    out = tmp_path / "mla.json"
    argv = ["bench", "mla", "--hidden-size", "64", "--layers", "2", "--intermediate-size", "128", "--heads", "4",
            "--kv-lora-rank", "32", "--gqa-kv-heads", "2", "--gqa-head-dim", "16", "--batch-size", "4",
            "--context", "24", "--output-len", "5", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "decode tok/s MLA / GQA" in printed and "prefill:" in printed
    r = json.loads(out.read_text())
    mla, gqa = r["mla"], r["gqa"]
    assert mla["kv_bytes_per_token"] == 2 * (32 + 64) * 4  # layers x (latent + rotary key) x fp32
    assert mla["expanded_kv_bytes_per_token"] == 2 * 4 * (128 + 64 + 128) * 4  # every head's K and V
    assert gqa["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert mla["decode_steps"] == gqa["decode_steps"] >= 5 and mla["tok_per_s"] > 0 and gqa["tok_per_s"] > 0
    assert mla["prefill_tok_per_s"] > 0 and gqa["prefill_tok_per_s"] > 0
    assert r["deepseek_v2_lite_bf16"] == [27 * 576 * 2, 27 * 16 * 320 * 2]


def test_bench_window_runs_a_request_longer_than_its_cache(tmp_path, capsys):
    out = tmp_path / "window.json"
    argv = ["bench", "window", "--window", "32", "--input-len", "300", "--output-len", "6", "--cache-tokens", "96",
            "--block-size", "4", "--max-num-batched-tokens", "16", "--hidden-size", "64", "--layers", "2",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "peak held" in capsys.readouterr().out
    r = json.loads(out.read_text())
    # The window, one 16-token chunk and a partial block at each end, in a 96-token cache: not 306 tokens.
    assert 32 < r["peak_tokens_held"] <= 32 + 16 + 8 and r["peak_tokens_held"] < r["cache_tokens"]
    assert r["prefill_tok_per_s"] > 0 and r["tpot_ms"] > 0


def test_bench_lora_runs_base_one_and_mixed_adapters(tiny_dir, tmp_path, capsys):
    """`ferry bench lora` writes random adapters for the model, loads them, and times the same
    requests without an adapter, under one, and spread over all of them."""
    out = tmp_path / "lora.json"
    argv = ["bench", "lora", "--model", tiny_dir, "--num-prompts", "4", "--input-len", "16", "--output-len", "6",
            "--num-adapters", "3", "--rank", "4", "--targets", "q_proj", "down_proj", "--json", str(out),
            *ENGINE]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "3 adapters of rank 4 on q_proj, down_proj" in printed
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["base", "one", "mixed"]
    assert runs["base"]["step_vs_base"] == 1.0
    for r in runs.values():
        assert r["output_tok_per_s"] > 0 and r["decode_step_ms"] > 0
