"""`--quantization int8` on the real SmolLM2: how far it moves the model from fp32.

Teacher-forced over a fixed text: every position's next-token distribution of
the int8 model against the fp32 one (KL, top-1 agreement, perplexity), then a
greedy generation through the engine. Measured on ferry bench quality's DEFAULT_TEXT (231 tokens), with
VNNI (8-bit weights): KL 0.012, top-1 agreement 0.94, perplexity 17.79 -> 17.88 (+0.5%); on an AVX2-only
CPU (7-bit weights, layers/int8_linear.py: weight_qmax): KL 0.027, top-1 0.92, perplexity -> 18.79 (+5.6%).
"""

from __future__ import annotations

import pytest
from conftest import assert_no_blocks_referenced, run_to_completion

from ferry.bench.quality import DEFAULT_TEXT, compare
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.layers.int8_linear import int8_linear_available, weight_qmax
from ferry.layers.linear import Linear
from ferry.models.weight_memory import held_weight_bytes
from ferry.sampling_params import SamplingParams
from ferry.worker.model_loading import load_model

pytestmark = pytest.mark.skipif(not int8_linear_available(), reason="torch built without oneDNN int8 ops")


@pytest.fixture(scope="module")
def int8_model():
    return load_model(EngineArgs(device="cpu", dtype="float32", quantization="int8"))


def test_one_copy_of_each_weight_in_fp32_and_int8(smollm, int8_model):
    """Packing (fp32) and quantizing (int8) replace each projection's float weight instead of keeping
    it beside the new copy: fp32 holds 4 bytes a weight, int8 1 byte plus 12 per row (an fp32 scale and
    oneDNN's int64 zero point), under 3% more."""
    cfg = smollm[0].config
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * cfg.intermediate_size  # qkv, o, gate_up, down
    weights = cfg.num_hidden_layers * per_layer
    table = cfg.vocab_size * h
    for model, weight_bytes in ((smollm[0], 4), (int8_model[0], 1)):
        assert all(m.weight is None for m in model.modules() if isinstance(m, Linear))
        held = held_weight_bytes(model)
        assert weight_bytes * weights <= held["projections"] < weight_bytes * weights * 1.03
        assert held["embedding"] == 4 * table  # the tied table, kept for lookups
        assert weight_bytes * table <= held["head"] < weight_bytes * table * 1.03  # its packed / int8 copy
    assert held_weight_bytes(int8_model[0])["total"] < 0.4 * held_weight_bytes(smollm[0])["total"]


def test_int8_next_token_distributions_stay_close_to_fp32(smollm, int8_model):
    fp32, tokenizer = smollm[0], smollm[1]
    ids = tokenizer.encode(DEFAULT_TEXT)
    assert len(ids) > 200
    r = compare(fp32, int8_model[0], ids)
    assert r["kl_mean"] < 0.03, r
    assert r["top1_agreement"] >= 0.88, r
    # 7-bit weights (no VNNI) double the weight step; the KL and top-1 bounds hold for both.
    assert r["ppl_candidate"] < (1.04 if weight_qmax() == 127 else 1.08) * r["ppl_reference"], r
    # The comparison itself: a model against itself is identical.
    same = compare(fp32, fp32, ids[:50])
    assert same["kl_mean"] < 1e-6 and same["top1_agreement"] == 1.0


def test_int8_engine_generates_and_frees_its_blocks(int8_model):
    model, tokenizer, device, dtype, path = int8_model
    engine = LLMEngine(
        EngineArgs(model=path, device="cpu", dtype="float32", quantization="int8", num_kv_blocks=64),
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8)
    engine.add_request("paris", "The capital of France is", params)
    engine.add_request("other", "List three colours:", SamplingParams(temperature=0.8, seed=1, max_tokens=8))
    done = run_to_completion(engine)
    assert done["paris"].outputs[0].text.startswith(" Paris")
    assert len(done["other"].outputs[0].token_ids) == 8
    assert_no_blocks_referenced(engine)


def test_quantization_is_validated_before_loading():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int4")
    with pytest.raises(ValueError, match="needs --dtype float32"):
        load_model(EngineArgs(device="cpu", dtype="bfloat16", quantization="int8"))
