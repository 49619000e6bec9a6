"""`--quantization int8` on the real SmolLM2: how far it moves the model from fp32.

Teacher-forced over a fixed text: every position's next-token distribution of
the int8 model against the fp32 one (KL, top-1 agreement, perplexity), then a
greedy generation through the engine. Measured on TEXT at introduction: KL
0.013, top-1 agreement 0.93, perplexity 17.79 -> 18.02 (+1.3%).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_blocks_referenced, run_to_completion

from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine, load_model
from ferry.layers.int8_linear import int8_linear_available
from ferry.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not int8_linear_available(), reason="torch built without oneDNN int8 ops")

TEXT = (
    "The river begins high in the mountains, where snow melts each spring and feeds a hundred small "
    "streams. By the time it reaches the valley it is wide and slow, and the town that grew up on its "
    "banks has depended on it for centuries: for water, for fish, and for the barges that carried "
    "grain and timber down to the sea. In the nineteenth century a railway arrived, and the barges "
    "slowly disappeared. Today the old warehouses along the quay have become restaurants, a museum "
    "and a library, and on summer evenings people sit by the water and watch the light fade.\n\n"
    "To compute the average of a list of numbers in Python, add them with sum() and divide by len(); "
    "for an empty list, decide first what the answer should be, because dividing by zero raises a "
    "ZeroDivisionError. The statistics module offers mean(), median() and stdev() as well.\n\n"
    "Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius, or 212 degrees "
    "Fahrenheit. At higher altitudes the air pressure is lower, so water boils at a lower temperature."
)


@pytest.fixture(scope="module")
def int8_model():
    return load_model(EngineArgs(device="cpu", dtype="float32", quantization="int8"))


def test_int8_next_token_distributions_stay_close_to_fp32(smollm, int8_model):
    fp32, tokenizer = smollm[0], smollm[1]
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 200
    ref = fp32.compute_logits(fp32._forward_prompt(ids)).log_softmax(-1)
    got = int8_model[0].compute_logits(int8_model[0]._forward_prompt(ids)).log_softmax(-1)
    target = torch.tensor(ids[1:])[:, None]
    ppl_ref = (-ref[:-1].gather(1, target).mean()).exp().item()
    ppl_got = (-got[:-1].gather(1, target).mean()).exp().item()
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert kl < 0.03, kl
    assert agree >= 0.88, agree
    assert ppl_got < 1.04 * ppl_ref, (ppl_got, ppl_ref)


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
    with pytest.raises(ValueError, match="quantization must be one of int8"):
        EngineArgs(quantization="int4")
    with pytest.raises(ValueError, match="needs --dtype float32"):
        load_model(EngineArgs(device="cpu", dtype="bfloat16", quantization="int8"))
