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


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_bad_words_and_allowed_token_ids(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "Write a sentence about the sea."
    free = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]

    def spellings(word: str) -> list[list[int]]:
        return [tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)]

    # Each of the free output's words whose tokens it holds, banned one at a time and all together.
    words = [w for w in dict.fromkeys(free.text.split()) if w.isalpha()
             and any(_contains(free.token_ids, s) for s in spellings(w))][:3]  # fmt: skip
    assert words, free.text
    for banned in ([words[0]], words):
        out = llm.generate(prompt, params.clone(bad_words=banned), use_tqdm=False)[0].outputs[0]
        assert out.token_ids != free.token_ids
        assert not any(_contains(out.token_ids, s) for w in banned for s in spellings(w)), (banned, out.text)
    # Only these tokens, greedy or sampled.
    allowed = tok.encode(" yes no maybe", add_special_tokens=False)
    for p in (params, params.clone(temperature=1.0, seed=1)):
        out = llm.generate(prompt, p.clone(allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 24 and set(out.token_ids) <= set(allowed)
    for field, value in (("allowed_token_ids", [10**7]), ("allowed_token_ids", []), ("bad_words", [" "]),
                         ("bad_words", "sea")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            llm.generate(prompt, params.clone(**{field: value}), use_tqdm=False)
    # Nothing left to sample is refused up front: every allowed token a bad word, or a stop before min_tokens.
    sea = tok.encode("sea", add_special_tokens=False)
    with pytest.raises(ValueError, match="bad_words forbid every allowed token"):
        llm.generate(prompt, params.clone(allowed_token_ids=sea, bad_words=["sea"]), use_tqdm=False)
    eos = tok.eos_token_id
    with pytest.raises(ValueError, match="min_tokens cannot be met"):
        llm.generate(prompt, SamplingParams(allowed_token_ids=[eos], min_tokens=2), use_tqdm=False)
    assert_no_blocks_referenced(llm.llm_engine)


def test_truncate_prompt_tokens_keeps_the_prompts_tail(llm):
    tok = llm.get_tokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 3
    ids = tok.encode(text)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cut = llm.generate(text, params.clone(truncate_prompt_tokens=7), use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": ids[-7:]}, params, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-7:] and cut.prompt is None
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    whole = llm.generate(text, params.clone(truncate_prompt_tokens=1000), use_tqdm=False)[0]
    assert whole.prompt == text and whole.prompt_token_ids == ids  # a shorter prompt is left as it is
    # -1: as much as the context (512) holds with room for one token; a prompt past it runs instead of failing.
    past = (ids * 40)[:700]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": past}, params, use_tqdm=False)
    most = llm.generate({"prompt_token_ids": past}, params.clone(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert most.prompt_token_ids == past[-511:] and len(most.outputs[0].token_ids) == 1
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    assert_no_blocks_referenced(llm.llm_engine)
