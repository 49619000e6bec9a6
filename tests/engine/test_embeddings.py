"""Embeddings in the generating engine: pooled final hidden states equal Hugging Face's
(`last_hidden_state`, after the final norm) for last / mean / cls pooling, however the prompt is
chunked, next to generating requests, with the prefix cache warm; a text's vector is the same
alone or in a batch of 32 (dynamic batching holding them); held requests abort cleanly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_no_blocks_referenced, engine_over, run_to_completion

from ferry.config import EngineArgs
from ferry.entrypoints.llm import LLM
from ferry.sampling_params import InvalidParameterError, PoolingParams, SamplingParams
from ferry.worker.model_loading import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random-weight Qwen3-shaped model, saved, its HF twin, and prompts."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, initializer_range=0.2,
                                   tie_word_embeddings=False)  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 7, 17, 40)]
    with torch.no_grad():
        hidden = [hf.model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    loaded = load_model(EngineArgs(model=str(path), device="cpu", dtype="float32"))
    return loaded, prompts, hidden


def hf_pooled(h: torch.Tensor, kind: str, normalize: bool = True) -> np.ndarray:
    v = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[kind]
    return (torch.nn.functional.normalize(v, dim=0) if normalize else v).numpy()


def embed(engine, prompts, pooling: PoolingParams, others: int = 0) -> list[np.ndarray]:
    """Each prompt's vector from engine steps, with `others` generating requests beside them."""
    for i in range(others):
        engine.add_request(f"gen{i}", {"prompt_token_ids": [5, 6, 7, 8 + i]}, SamplingParams(max_tokens=6))
    for i, p in enumerate(prompts):
        engine.add_request(f"e{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=1, pooling=pooling))
    done = run_to_completion(engine)
    for i in range(others):
        assert len(done[f"gen{i}"].outputs[0].token_ids) == 6
    outs = [done[f"e{i}"] for i in range(len(prompts))]
    assert all(o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "stop" for o in outs)
    return [np.asarray(o.embedding) for o in outs]


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_hidden_states_match_hf(tiny, kind):
    loaded, prompts, hidden = tiny
    want = [hf_pooled(h, kind) for h in hidden]
    whole = engine_over(loaded, num_kv_blocks=64, embed_max_delay_ms=0)
    chunked = engine_over(loaded, num_kv_blocks=64, max_num_batched_tokens=5, embed_max_delay_ms=0)
    for engine, others in ((whole, 0), (whole, 3), (chunked, 2), (whole, 0)):  # the last: prefix cache warm
        got = embed(engine, prompts, PoolingParams(pooling_type=kind), others)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=2e-5)
    raw = embed(whole, prompts[2:3], PoolingParams(pooling_type=kind, normalize=False))[0]
    np.testing.assert_allclose(raw, hf_pooled(hidden[2], kind, normalize=False), rtol=1e-4, atol=1e-4)
    assert_no_blocks_referenced(whole)
    assert_no_blocks_referenced(chunked)


TEXTS = [
    f"Sentence {i}: {'a cat sleeps on the mat' if i % 2 else 'markets fell on Tuesday'} ({i * 7})." for i in range(32)
]


def test_the_same_text_alone_or_in_a_batch_of_32(smollm):
    """The issue's check, through LLM.embed: with dynamic batching on, the 32 are held and run as
    one batch; alone, one request waits out the delay and runs by itself."""
    llm = LLM.from_engine(engine_over(smollm, embed_max_delay_ms=20, embed_max_batch=32))
    batch = llm.embed(TEXTS, use_tqdm=False)
    alone = [llm.embed(t, use_tqdm=False)[0] for t in TEXTS[:3] + TEXTS[-2:]]
    for a, b in zip(alone, batch[:3] + batch[-2:]):
        assert len(a.outputs.embedding) == 576
        np.testing.assert_allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-5)
        assert abs(np.linalg.norm(a.outputs.embedding) - 1.0) < 1e-5
    similar = np.dot(batch[1].outputs.embedding, batch[3].outputs.embedding)
    different = np.dot(batch[1].outputs.embedding, batch[2].outputs.embedding)
    assert similar > different  # two cat sentences are nearer each other than a cat and a market one


def test_score_is_the_cosine_of_the_pooled_hidden_states(tiny):
    """LLM.score (vLLM's, for an embedding model): each pair's cosine similarity of HF's pooled
    (last token) hidden states; one text_1 against each text_2, or pairwise."""
    loaded, prompts, hidden = tiny
    llm = LLM.from_engine(engine_over(loaded))
    vec = [hf_pooled(h, "last") for h in hidden]
    ids = [{"prompt_token_ids": p} for p in prompts]
    one = llm.score(ids[0], ids[1:], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in one], [vec[0] @ v for v in vec[1:]], atol=1e-5)
    assert one[1].prompt_token_ids == prompts[0] + prompts[2]
    pairs = llm.score(ids[:2], ids[2:], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in pairs], [vec[0] @ vec[2], vec[1] @ vec[3]], atol=1e-5)
    with pytest.raises(ValueError, match="text_1 has 2 prompts and text_2 3"):
        llm.score(ids[:2], ids[1:], use_tqdm=False)


def test_held_embeddings_abort_and_bad_ones_are_refused(smollm):
    engine = engine_over(smollm, embed_max_delay_ms=10_000, embed_max_batch=4)
    params = SamplingParams(max_tokens=1, pooling=PoolingParams())
    engine.add_request("held", TEXTS[0], params)
    engine.step()
    assert engine.has_unfinished_requests() and not engine.scheduler.requests  # held, not scheduled
    engine.abort_request("held")
    assert not engine.has_unfinished_requests()
    for bad in (SamplingParams(n=2, pooling=PoolingParams()), SamplingParams(logprobs=1, pooling=PoolingParams())):
        with pytest.raises(InvalidParameterError):
            engine.add_request("bad", TEXTS[0], bad)
    with pytest.raises(InvalidParameterError):
        PoolingParams(pooling_type="max")
    for i in range(4):  # a full batch goes at once, delay or not
        engine.add_request(f"e{i}", TEXTS[i], params)
    done = run_to_completion(engine, max_steps=50)
    assert all(done[f"e{i}"].embedding for i in range(4))
    assert_no_blocks_referenced(engine)
