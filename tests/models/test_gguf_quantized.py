"""The bundled Q4_1 GGUF run as stored (the default, `--quantization auto` -> gguf) against the same
file dequantized to fp32 (`--quantization none`, the HF-exact reference). Measured on ferry bench
quality's DEFAULT_TEXT (231 tokens): the int8 dots (int8 activations per 32 values; every row of this
Q4_1/Q8_0 file) KL 0.0026, top-1 agreement 0.965, perplexity 17.79 -> 17.90 (+0.6%); the exact path
(exact_prompt_rows) dequantizes into an fp32 GEMM."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_no_blocks_referenced, run_to_completion

from ferry.bench.quality import DEFAULT_TEXT, compare
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.layers.gguf_linear import exact_prompt_rows, gguf_available
from ferry.layers.linear import Linear
from ferry.models.paths import default_model_path
from ferry.models.weight_arena import step_order
from ferry.models.weight_memory import held_weight_bytes
from ferry.sampling_params import SamplingParams
from ferry.worker.model_loading import load_model

pytestmark = pytest.mark.skipif(not gguf_available(), reason="no C++ compiler for the CPU kernels")


@pytest.fixture(scope="module")
def gguf_model(smollm_gguf):
    return smollm_gguf  # no flag: a quantized GGUF runs as stored


def test_weights_stay_quantized_and_are_the_only_copy(gguf_model):
    import gguf

    model = gguf_model.model
    assert model.quantization == "gguf"
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.gguf and m.packed is None for m in linears)
    # q, k, v in one, interleaved by 8 rows for the CPU kernel
    assert [p.type_name for p in model.layers[0].self_attn.qkv_proj.gguf] == ["Q4_1x8"]
    assert model.embed_tokens.weight is None and model.embed_tokens.gguf.type_name == "Q8_0x8"  # the head layout
    assert model._gguf_lm_head is model.embed_tokens.gguf  # tied: one copy
    held = held_weight_bytes(model)  # every weight tensor the model holds, each counted once
    file_tensors = sum(int(t.n_bytes) for t in gguf.GGUFReader(default_model_path()).tensors)
    assert held["head"] == 0 and held["embedding"] == model.embed_tokens.gguf.nbytes
    assert file_tensors * 0.999 <= held["total"] <= 1.001 * file_tensors  # the file's bytes, nothing beside them
    # ... all in one huge-page arena, in the order a decode step reads them (models/weight_arena.py)
    order = step_order(model)
    assert len(order) == 4 * len(model.layers) + 1 and order[-1] is model._gguf_lm_head
    starts = [w.data.data_ptr() for w in order]
    assert starts == sorted(starts) and len({w.data.untyped_storage().data_ptr() for w in order}) == 1


def test_next_token_distributions_stay_close_to_the_dequantized_model(smollm, gguf_model):
    reference, tokenizer = smollm[0], smollm[1]
    ids = tokenizer.encode(DEFAULT_TEXT)
    with exact_prompt_rows():  # the reference path: dequantize + fp32 GEMM
        exact = compare(reference, gguf_model.model, ids)
    assert exact["kl_mean"] < 1e-5 and exact["top1_agreement"] == 1.0, exact
    # What the engine computes for Q4_1 / Q8_0 prompts and decode alike: int8 activations, integer dots
    r = compare(reference, gguf_model.model, ids)
    assert 1e-5 < r["kl_mean"] < 0.01, r
    assert r["top1_agreement"] >= 0.93, r
    assert r["ppl_candidate"] < 1.02 * r["ppl_reference"], r


def test_engine_generates_with_quantized_weights(gguf_model):
    model, tokenizer, device, dtype, path = gguf_model
    engine = LLMEngine(EngineArgs(model=path, device="cpu", num_kv_blocks=64), model=model, tokenizer=tokenizer,
                       device=device, dtype=dtype)  # fmt: skip
    engine.add_request("paris", "The capital of France is Paris. The capital of Germany is",
                       SamplingParams(temperature=0.0, max_tokens=6))  # fmt: skip
    engine.add_request("other", "List three colours:", SamplingParams(temperature=0.8, seed=1, max_tokens=8))
    done = run_to_completion(engine)
    assert done["paris"].outputs[0].text.startswith(" Berlin")
    assert len(done["other"].outputs[0].token_ids) == 8
    assert_no_blocks_referenced(engine)


def test_bundled_gguf_runs_quantized_under_tensor_parallelism(gguf_model):
    """SmolLM2's 9 heads / 3 kv heads over 3 CPU ranks (gloo), its blocks sharded as stored: q/k/v and
    gate/up by rows, o/down by whole 32-blocks of their input columns, the tied Q8_0 embedding / head
    by vocab rows. A block's int8 dot is the same on either side of a split; o/down's partial sums
    are added in another order, a rounding-level difference that int8 activations can amplify a
    few tokens on (as between llama.cpp builds), so the check is TP=1's first tokens and their
    logprobs (a misplaced shard gives other text from the first token on)."""
    model, tokenizer, device, dtype, path = gguf_model
    prompts = ["The capital of France is Paris. The capital of Germany is", "def fibonacci(n):"]

    def greedy(engine: LLMEngine) -> list:
        try:
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=12, logprobs=1))
            done = run_to_completion(engine)
            assert_no_blocks_referenced(engine)
            return [done[str(i)].outputs[0] for i in range(len(prompts))]
        finally:
            engine.shutdown()

    ref = greedy(LLMEngine(EngineArgs(model=path, device="cpu", num_kv_blocks=64), model=model, tokenizer=tokenizer,
                           device=device, dtype=dtype))  # fmt: skip
    tp3 = LLMEngine(EngineArgs(model=path, device="cpu", num_kv_blocks=64, tensor_parallel_size=3))
    assert tp3.model.quantization == "gguf" and tp3.model.embed_tokens.gguf.out_features == 49152 // 3
    assert tp3.model.layers[0].mlp.down_proj.gguf[0].in_features == 1536 // 3
    got = greedy(tp3)
    assert got[0].text.startswith(" Berlin") and ref[0].text.startswith(" Berlin")
    for a, b in zip(got, ref):
        assert a.token_ids[0] == b.token_ids[0]
        first = [next(iter(out.logprobs[0].values())).logprob for out in (a, b)]
        assert abs(first[0] - first[1]) < 0.05, first


def test_prompt_rows_compute_the_same_however_the_prompt_is_chunked(gguf_model):
    """A chunked prefill (or a PD decode worker recomputing a prompt's tail) against a whole one. On
    the exact path (the K-quants' prompt rows; here forced) the first token's distribution is the
    same to fp32 GEMM rounding. Q4_1/Q8_0 prompt rows take the int8 dots, which compute a row the
    same whatever rows are beside it; the attention over a chunk and its cached prefix rounds apart
    from a whole prompt's, and int8 activations amplify that (as in llama.cpp) to ~0.1 in a logprob
    here: the same greedy text up to a near tie, if any (each run's token then among the other's five
    likeliest and within 0.25 of its best: on an AVX2-only EPYC the first token was one, each run's
    three likeliest within 0.14), the first token's logprob within 0.25."""
    model, tokenizer, device, dtype, path = gguf_model
    prompt = DEFAULT_TEXT[:400]

    def greedy(**kwargs):
        engine = LLMEngine(EngineArgs(model=path, device="cpu", num_kv_blocks=64, **kwargs), model=model,
                           tokenizer=tokenizer, device=device, dtype=dtype)  # fmt: skip
        engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=12, logprobs=5))
        return run_to_completion(engine)["a"].outputs[0]

    def first_logprob(out, token) -> float:
        return out.logprobs[0][token].logprob

    def same_up_to_a_near_tie(a, b) -> bool:
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                return (x in b.logprobs[i] and y in a.logprobs[i]
                        and a.logprobs[i][x].logprob - a.logprobs[i][y].logprob < 0.25
                        and b.logprobs[i][y].logprob - b.logprobs[i][x].logprob < 0.25)  # fmt: skip
        return a.token_ids == b.token_ids

    def chunked_and_whole():
        return greedy(max_num_batched_tokens=7, enable_prefix_caching=False), greedy(enable_prefix_caching=False)

    with exact_prompt_rows():
        chunked, whole = chunked_and_whole()
    # Later tokens are not bounded this tightly: decode rows are int8 on both.
    first = whole.token_ids[0]
    assert chunked.token_ids[0] == first
    assert abs(first_logprob(chunked, first) - first_logprob(whole, first)) < 2e-5
    int8_chunked, int8_whole = chunked_and_whole()
    assert same_up_to_a_near_tie(int8_chunked, int8_whole), (int8_chunked.token_ids, int8_whole.token_ids)
    int8_first = int8_whole.token_ids[0]  # among int8_chunked's five likeliest, as checked just above
    assert abs(first_logprob(int8_chunked, int8_first) - first_logprob(int8_whole, int8_first)) < 0.25
    assert abs(first_logprob(int8_whole, first) - first_logprob(whole, first)) < 0.25


def test_quantization_choices(tmp_path):
    # An explicit gguf on a checkpoint that is not one is refused before any weight is read.
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 64, '
                                          '"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 2}')  # fmt: skip
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        load_model(EngineArgs(model=str(tmp_path), device="cpu", quantization="gguf"))
    # Dummy weights with gguf: random Q4_0 projections (to measure the kernels), a float embedding.
    dummy = load_model(EngineArgs(model=str(tmp_path), device="cpu", quantization="gguf", load_format="dummy")).model
    down = dummy.layers[0].mlp.down_proj
    assert dummy.quantization == "gguf" and down.weight is None and [w.type_name for w in down.gguf] == ["Q4_0x8"]
    assert dummy.embed_tokens.gguf is None and 0.01 < down.gguf[0].dequantize().std().item() < 0.03
    with pytest.raises(ValueError, match="float32 activations"):
        load_model(EngineArgs(device="cpu", dtype="bfloat16", quantization="gguf"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="q4")
    # auto where the kernels cannot run (bf16 activations): the file dequantized, as before.
    loaded = load_model(EngineArgs(device="cpu", dtype="bfloat16"))
    assert loaded.model.quantization is None and os.path.isfile(loaded.path)
    assert loaded.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
