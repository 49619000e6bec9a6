"""vLLM's prompt_logprobs: every prompt token's logprob, rank and top alternatives equal Hugging
Face's (the log-softmax of the logits at the position before it), whole, chunked, with the prefix
cache warm (such requests compute their whole prompt) and for n > 1."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_blocks_referenced, engine_over, run_to_completion
from test_embeddings import tiny  # noqa: F401  (the fixture: a random Qwen3-shaped model and its HF twin)

from ferry.sampling_params import InvalidParameterError, SamplingParams

K = 3


@pytest.fixture(scope="module")
def hf_logprobs(tiny):  # noqa: F811
    import transformers

    loaded, prompts, _ = tiny
    hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].float().log_softmax(dim=-1) for p in prompts]


def run(engine, prompts, **kw) -> list:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=2, prompt_logprobs=K, **kw))
    done = run_to_completion(engine)
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_prompt_logprobs_match_hf(tiny, hf_logprobs):  # noqa: F811
    loaded, prompts, _ = tiny
    whole = engine_over(loaded, num_kv_blocks=64)
    chunked = engine_over(loaded, num_kv_blocks=64, max_num_batched_tokens=5)
    for engine, kw in ((whole, {}), (chunked, {}), (whole, {}), (whole, {"n": 2, "temperature": 1.0, "seed": 3})):
        for out, p, ref in zip(run(engine, prompts, **kw), prompts, hf_logprobs):
            got = out.prompt_logprobs
            assert len(got) == len(p) and got[0] is None
            for pos in range(1, len(p)):
                entry, row = got[pos], ref[pos - 1]
                assert abs(entry[p[pos]].logprob - row[p[pos]].item()) < 1e-4
                assert entry[p[pos]].rank == int((row > row[p[pos]]).sum()) + 1
                for t in row.topk(K).indices.tolist():  # the alternatives: HF's top K, with its values
                    assert abs(entry[t].logprob - row[t].item()) < 1e-4
    assert whole.get_stats().prefix_cache_hits == 0  # the warm rerun computed its prompts again
    assert_no_blocks_referenced(whole)
    assert_no_blocks_referenced(chunked)


def test_bad_prompt_logprobs_are_refused(tiny):  # noqa: F811
    with pytest.raises(InvalidParameterError):
        SamplingParams(prompt_logprobs=-1)
    engine = engine_over(tiny[0], num_kv_blocks=16)
    with pytest.raises(InvalidParameterError):
        engine.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(prompt_logprobs=10**6))
