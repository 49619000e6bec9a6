"""LLM.beam_search (vLLM's algorithm, ferry/entrypoints/beam_search.py) against the same search written out here
over Hugging Face's own next-token logprobs, on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from ferry import LLM, BeamSearchParams

WIDTH, MAX_TOKENS = 3, 6
PROMPTS = [[5, 9, 11, 200, 3], [42] * 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.3, tie_word_embeddings=False, eos_token_id=7)  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # EOS: the second likeliest token after PROMPTS[0], so beams finish there and others go on.
    with torch.no_grad():
        eos = hf(torch.tensor([PROMPTS[0]])).logits[0, -1].topk(2).indices[1].item()
    hf.config.eos_token_id = hf.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return hf, LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=128), eos


def reference(hf, prompt: list[int], width: int, max_tokens: int, eos: int, length_penalty: float):
    """vLLM's beam search over HF's logprobs: (tokens, cumulative logprob) of the best beams."""

    def score(tokens, cum):
        return cum / (len(tokens) - (tokens[-1] == eos)) ** length_penalty

    beams, done = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        new = []
        for tokens, cum in beams:
            with torch.no_grad():
                lp = hf(torch.tensor([tokens])).logits[0, -1].log_softmax(-1)
            for t in lp.topk(2 * width).indices.tolist():
                (done if t == eos else new).append((tokens + [t], cum + lp[t].item()))
        beams = sorted(new, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(done + beams, key=lambda b: score(*b), reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beams_are_the_reference_search_over_hf_logprobs(tiny, length_penalty):
    hf, llm, eos = tiny
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(WIDTH, MAX_TOKENS, length_penalty=length_penalty))  # fmt: skip
    reasons = []
    for p, out in zip(PROMPTS, outs):
        want = reference(hf, p, WIDTH, MAX_TOKENS, eos=eos, length_penalty=length_penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        for s, (_, cum) in zip(out.sequences, want):
            assert s.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert len(s.logprobs) == len(s.tokens) - len(p)
            assert s.finish_reason == ("stop" if s.tokens[-1] == eos else "length")
            reasons.append(s.finish_reason)
    if length_penalty == 0.0:  # no length normalisation: the one-token beam ending in EOS scores best
        assert outs[0].sequences[0].tokens == PROMPTS[0] + [eos] and "length" in reasons


def test_width_one_is_greedy_and_bad_params_are_refused(tiny):
    _, llm, _ = tiny
    from ferry import SamplingParams

    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    beam = llm.beam_search(prompt, BeamSearchParams(1, 8, ignore_eos=True))[0].sequences
    assert len(beam) == 1 and beam[0].tokens[4:] == greedy[0].outputs[0].token_ids
    for bad, field in (({"beam_width": 0}, "beam_width"), ({"beam_width": 129}, "beam_width"),
                       ({"max_tokens": 0}, "max_tokens"), ({"length_penalty": 400}, "length_penalty")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
    # Beams stop where the context does (256 tokens here): no round past it.
    long = llm.beam_search({"prompt_token_ids": [3] * 253}, BeamSearchParams(2, 50, ignore_eos=True))[0]
    assert {len(s.tokens) for s in long.sequences} == {256}
    with pytest.raises(ValueError, match="no room left"):
        llm.beam_search({"prompt_token_ids": [3] * 256}, BeamSearchParams(2, 4))
