"""The vLLM-style offline API over the shared SmolLM2 engine."""

import numpy as np
import pytest
import torch
from conftest import assert_no_blocks_referenced

from ferry import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(make_engine):
    return LLM.from_engine(make_engine(max_model_len=512))


def test_generate_strings_and_token_ids_in_order(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(["The capital of France is", {"prompt_token_ids": tok.encode("1, 2, 3,")}], params)
    assert [o.prompt_token_ids for o in outs] == [tok.encode("The capital of France is"), tok.encode("1, 2, 3,")]
    assert outs[1].prompt is None and outs[0].prompt == "The capital of France is"
    for o in outs:
        c = o.outputs[0]
        assert o.finished and len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # Token ids as numpy or torch integers, as they come out of other tools, are the same prompt.
    ids = tok.encode("1, 2, 3,")
    for array in (np.array(ids), torch.tensor(ids)):
        again = llm.generate({"prompt_token_ids": array}, params, use_tqdm=False)[0]
        assert again.prompt_token_ids == ids and again.outputs[0].token_ids == outs[1].outputs[0].token_ids
    for bad, why in (([1, 2.0], "not a token id"), ([True], "not a token id"), ([1, 10**7], "outside the vocabulary")):
        with pytest.raises(ValueError, match=why):
            llm.generate({"prompt_token_ids": bad}, params, use_tqdm=False)
    # One SamplingParams per prompt.
    outs2 = llm.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=3)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) <= n for o, n in zip(outs2, (2, 3))] == [True, True]


def test_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()
    assert_no_blocks_referenced(llm.llm_engine)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])
    for bad in ({"max_tokens": 2, "temperature": 0}, [SamplingParams(), {"max_tokens": 2}]):
        with pytest.raises(ValueError, match="sampling_params must be SamplingParams"):
            llm.generate(["a", "b"][: len(bad)], bad)
    for field, value in (("stop", 5), ("stop", [1]), ("stop_token_ids", 5)):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})


def test_chat_applies_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is 2+2? Answer with a number."}],
        SamplingParams(temperature=0, max_tokens=16),
    )[0]
    tok = llm.get_tokenizer()
    prompt_text = tok.decode(out.prompt_token_ids)
    assert "<|im_start|>user\nWhat is 2+2?" in prompt_text and prompt_text.endswith("<|im_start|>assistant\n")
    assert "4" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # SmolLM2 ends its turn with <|im_end|>
    assert out.prompt == prompt_text  # the rendered template, as vLLM's
    # OpenAI's message shapes, as the server takes them: content parts are the same prompt.
    parts = [{"type": "text", "text": "What is 2+2? "}, {"type": "text", "text": "Answer with a number."}]
    same = llm.chat([{"role": "user", "content": parts}], SamplingParams(temperature=0, max_tokens=16))[0]
    assert same.prompt_token_ids == out.prompt_token_ids and same.outputs[0].text == out.outputs[0].text
    for bad in ([], [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": [{"type": "x"}]}]):
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad, SamplingParams(max_tokens=1))
    assert_no_blocks_referenced(llm.llm_engine)
