"""Speculative decoding through whole engine steps on the real SmolLM2: greedy output is token-exact
with speculation off, for the fp32 model (Python forward) and the GGUF one (the C++ decode step
verifies the drafts), alone, batched with other requests, under preemption, with a warm prefix
cache, with drafts that are always wrong and always right; never a token past a stop or
max_tokens; every block freed. At temperature 1, tokens follow the model's distribution (a
chi-squared test against its own probabilities); the adaptive draft length's behaviour."""

from __future__ import annotations

import math

import pytest
from conftest import assert_no_blocks_referenced, engine_over, run_to_completion

from ferry.sampling_params import SamplingParams

# "fixed": every draft the proposer finds is verified, so these tests exercise verification
# whatever the adaptive policy would choose on this machine (its own tests are below).
NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5, '
    '"draft_length": "fixed"}'
)

# An editing task: the answer copies most of the prompt, so n-gram lookup finds drafts.
PASSAGE = (
    "def free(self, blocks):\n"
    "    for block in blocks:\n"
    "        block.ref_cnt -= 1\n"
    "        if block.ref_cnt == 0:\n"
    "            self._free[block.block_id] = block\n"
)


@pytest.fixture(scope="module", params=["fp32", "gguf"])
def loaded(request, smollm, smollm_gguf):
    return smollm if request.param == "fp32" else smollm_gguf


@pytest.fixture(scope="module")
def prompts(smollm):
    return spec_prompts(smollm.tokenizer)


def spec_prompts(tok) -> dict[str, list[int]]:
    """An editing prompt whose answer copies the passage, a story opening and a counting list."""
    chat = [{"role": "user", "content": "Rename the method free to release. Output only the code.\n\n" + PASSAGE}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    edit = tok.encode(text, add_special_tokens=False)
    return {
        "edit": edit,
        "story": tok.encode("Once upon a time, in a small village by the sea,"),
        "list": tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"),
    }


def generate(engine, prompts: dict[str, list[int]], max_tokens: int = 48, **params) -> dict[str, list[int]]:
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    for name, ids in prompts.items():
        engine.add_request(name, {"prompt_token_ids": ids}, p)
    done = run_to_completion(engine)
    return {name: done[name].outputs[0].token_ids for name in prompts}


@pytest.fixture(scope="module")
def reference(loaded, prompts):
    """Each prompt's greedy tokens alone, speculation off."""
    engine = engine_over(loaded)
    return {name: generate(engine, {name: ids})[name] for name, ids in prompts.items()}


def test_ngram_greedy_is_token_exact_alone_and_batched(loaded, prompts, reference):
    engine = engine_over(loaded, speculative_config=NGRAM)
    assert generate(engine, {"edit": prompts["edit"]}) == {"edit": reference["edit"]}
    alone = engine.get_stats()
    assert alone.spec_num_drafts > 0 and alone.spec_num_accepted_tokens > 0  # it did speculate
    assert alone.spec_num_draft_tokens >= alone.spec_num_accepted_tokens == sum(alone.spec_accepted_per_pos)
    assert generate(engine, prompts) == reference  # batched: drafts beside plain decodes
    assert_no_blocks_referenced(engine)


def test_drafts_always_wrong_or_always_right(loaded, prompts, reference):
    """Drafts from a proposer that is always wrong (a token the model never picks next) are all
    rejected; from one that knows the answer, all kept: the output is the same either way."""
    ids = prompts["edit"]
    want = reference["edit"]

    def wrong(request, room):
        return [want[0] if request.num_output_tokens else 0] * room  # never the next token

    def right(request, room):
        return want[request.num_output_tokens : request.num_output_tokens + room]

    for proposer, accepted_all in ((wrong, False), (right, True)):
        engine = engine_over(loaded, speculative_config=NGRAM)
        engine.core.proposer.ngram.propose = proposer
        assert generate(engine, {"edit": ids}) == {"edit": want}
        stats = engine.get_stats()
        assert stats.spec_num_draft_tokens > 0
        if accepted_all:
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        else:
            assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens // 4
        assert_no_blocks_referenced(engine)


def test_token_exact_under_preemption(loaded, prompts, reference):
    # 12 blocks of 16 tokens cannot hold the three sequences at once: some are preempted.
    engine = engine_over(loaded, speculative_config=NGRAM, num_kv_blocks=12)
    assert generate(engine, prompts) == reference
    assert engine.get_stats().num_preemptions > 0 and engine.get_stats().spec_num_accepted_tokens > 0
    assert_no_blocks_referenced(engine)


def test_warm_prefix_cache_and_kept_drafts_are_cached(loaded, prompts, reference):
    """Blocks filled by kept drafts enter the prefix cache like any other: the prompt plus its
    answer, sent again, finds all its full blocks cached."""
    engine = engine_over(loaded, speculative_config=NGRAM)
    ids = prompts["edit"]
    assert generate(engine, {"edit": ids}) == {"edit": reference["edit"]}
    assert generate(engine, {"edit": ids}) == {"edit": reference["edit"]}  # warm prefix
    full = ids + reference["edit"]
    hits_before = engine.get_stats().prefix_cache_hits
    generate(engine, {"again": full}, max_tokens=1)
    assert engine.get_stats().prefix_cache_hits - hits_before == (len(full) - 1) // 16 * 16
    assert_no_blocks_referenced(engine)


def test_never_past_max_tokens_or_a_stop_token(loaded, prompts, reference):
    want = reference["edit"]
    engine = engine_over(loaded, speculative_config=NGRAM)
    for n in (1, 2, 7):
        assert generate(engine, {"edit": prompts["edit"]}, max_tokens=n)["edit"] == want[:n]
    stop = want[9]  # a token the answer reaches after a few steps
    got = generate(engine, {"edit": prompts["edit"]}, stop_token_ids=[stop])["edit"]
    assert got == want[: want.index(stop) + 1]
    assert_no_blocks_referenced(engine)


def test_adaptive_draft_length_stops_verifying_drafts_that_fail(smollm_gguf, prompts):
    """The default policy on the real engine: always-wrong drafts are soon no longer verified (the
    request's acceptance estimate falls below what a row costs), drafts that are always right are
    all verified, and the output is the model's own either way."""
    loaded = smollm_gguf
    want = generate(engine_over(loaded), {"edit": prompts["edit"]}, max_tokens=40)["edit"]
    adaptive = NGRAM.replace('"fixed"', '"adaptive"')

    def wrong(request, room):
        return [want[0] if request.num_output_tokens else 0] * room

    def right(request, room):
        return want[request.num_output_tokens : request.num_output_tokens + room]

    def deterministic(engine):
        """Steps priced as on 2 CPU cores (a row a quarter of a 1-row step) rather than by the
        clock, so the test does not depend on how busy the machine is."""
        proposer = engine.core.proposer
        proposer.observe_step = lambda rows, seconds, *_: proposer.policy.observe_step(rows, 0.002 + 0.0005 * rows)
        return engine

    engine = deterministic(engine_over(loaded, speculative_config=adaptive))
    engine.core.proposer.ngram.propose = wrong
    assert generate(engine, {"edit": prompts["edit"]}, max_tokens=40) == {"edit": want}
    stats = engine.get_stats()
    # 39 steps could verify 4 drafts each (156): a few are tried, then drafts are mostly left out.
    assert 0 < stats.spec_num_draft_tokens < 39
    # The next request starts from evidence pooled over those failures, yet drafts are tried again
    # (the pooled evidence fades while nobody drafts), and kept once they are right.
    engine.core.proposer.ngram.propose = right
    assert generate(engine, {"edit": prompts["edit"]}, max_tokens=40) == {"edit": want}
    assert engine.get_stats().spec_num_accepted_tokens - stats.spec_num_accepted_tokens >= 20
    assert_no_blocks_referenced(engine)

    engine = deterministic(engine_over(loaded, speculative_config=adaptive))
    engine.core.proposer.ngram.propose = right
    assert generate(engine, {"edit": prompts["edit"]}, max_tokens=40) == {"edit": want}
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_num_drafts <= 40 // 5 + 1  # every step verified its full 4 drafts
    assert_no_blocks_referenced(engine)


def test_bad_speculative_config_is_a_clear_error(smollm):
    for bad, words in (
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "eagle9", "num_speculative_tokens": 2}', "method"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_mn": 2}', "unknown"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 2, "draft_length": "auto"}', "draft_length"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup"),
        ("not json", "JSON"),
    ):
        with pytest.raises(ValueError, match=words):
            engine_over(smollm, speculative_config=bad)


def _chi2_critical(df: int, z: float = 3.0902) -> float:
    """The 0.1% critical value of chi-squared with df degrees of freedom (Wilson-Hilferty)."""
    h = 2 / (9 * df)
    return df * (1 - h + z * h**0.5) ** 3


def test_sampling_with_speculation_keeps_the_models_distribution(smollm_gguf):
    """Temperature 1 on a repeating prompt, where the n-gram draft is what the model samples about
    three times in four: over 500 seeded requests with speculation, the token after the most
    common first token follows the model's own distribution there (its top 20 probabilities,
    taken without speculation, the rest pooled) by a chi-squared test at 0.1%, with that draft
    both kept and rejected. Deterministic: fixed seeds. (Keeping a sampled row's draft whenever
    it is the row's most likely token fails it: chi-squared 91 at 400 requests, 232 at 1000, for
    a bound of 18.5; each request computes its whole prompt, so 500 halve the test's time.)"""
    n = 500
    ids = smollm_gguf.tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1,")
    engine = engine_over(smollm_gguf, max_num_seqs=256, speculative_config=NGRAM)
    for i in range(n):
        params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i)  # a draft for the 2nd
        engine.add_request(f"s{i}", {"prompt_token_ids": ids}, params)
    done = run_to_completion(engine)
    stats = engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # kept and rejected
    assert_no_blocks_referenced(engine)
    assert_second_token_follows_the_model(smollm_gguf, ids, [done[f"s{i}"].outputs[0].token_ids for i in range(n)])


def assert_second_token_follows_the_model(loaded, ids: list[int], outputs: list[list[int]]) -> None:
    """Among `outputs` (sampled after `ids`), those whose first token is the most common one have
    a second token distributed as the model's own after prompt + that token (its top 20
    probabilities, taken without speculation, the rest pooled): chi-squared at 0.1%."""
    from collections import Counter

    first, _ = Counter(t[0] for t in outputs).most_common(1)[0]
    second = Counter(t[1] for t in outputs if t[0] == first)
    drawn = sum(second.values())
    assert drawn > len(outputs) // 2

    # The model's distribution after prompt + first, without speculation.
    plain = engine_over(loaded)
    plain.add_request("p", {"prompt_token_ids": ids + [first]}, SamplingParams(max_tokens=1, logprobs=20))
    top = run_to_completion(plain)["p"].outputs[0].logprobs[0]
    probs = {token: math.exp(lp.logprob) for token, lp in top.items()}
    cats = [(second[t], p * drawn) for t, p in probs.items() if p * drawn >= 5]
    kept = {t for t, p in probs.items() if p * drawn >= 5}
    rest_expected = drawn - sum(e for _, e in cats)
    cats.append((drawn - sum(second[t] for t in kept), rest_expected))
    stat = sum((o - e) ** 2 / e for o, e in cats if e > 0)
    df = len(cats) - 1
    assert df >= 2 and stat < _chi2_critical(df), (stat, df, cats)


def test_stop_strings_and_streamed_deltas_are_as_without_speculation(smollm_gguf, prompts):
    """A stop string met inside a step that kept several drafts ends the text and the tokens where
    it would without speculation (nothing after it reported); streamed deltas, which may carry
    several tokens, add up to the final text."""
    from ferry.sampling_params import RequestOutputKind

    plain = engine_over(smollm_gguf)
    ids = prompts["edit"]
    # The whole answer (it ends by itself within 160 tokens): how much it writes before copying the code
    # moves with last-bit changes to the kernels, and a 96-token cap once cut it off just short of
    # the stop string.
    text = smollm_gguf.tokenizer.decode(generate(plain, {"edit": ids}, max_tokens=256)["edit"])
    stop = "block_id"  # in the code the answer copies from the prompt, where drafts are kept
    assert text.count(stop) == 1

    def run(engine, kind):
        params = SamplingParams(temperature=0.0, max_tokens=256, stop=[stop], output_kind=kind)
        engine.add_request("s", {"prompt_token_ids": ids}, params)
        pieces, last = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                pieces.append(out.outputs[0].text)
                last = out
        return last.outputs[0], pieces

    want, _ = run(plain, RequestOutputKind.FINAL_ONLY)
    assert want.finish_reason == "stop" and stop not in want.text
    engine = engine_over(smollm_gguf, speculative_config=NGRAM)
    got, _ = run(engine, RequestOutputKind.FINAL_ONLY)
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    streamed, pieces = run(engine, RequestOutputKind.DELTA)
    assert "".join(pieces) == want.text and streamed.finish_reason == "stop"
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens > stats.spec_num_drafts  # steps kept several drafts
    assert_no_blocks_referenced(engine)


@pytest.mark.parametrize("draft_length", ["fixed", "adaptive"])
def test_seeded_sampling_is_token_exact_with_speculation_off(smollm_gguf, prompts, draft_length):
    """A seeded request's k-th token is drawn with noise keyed by (seed, k) and a draft is kept
    only when it equals that draw, so with speculation (verifying every draft, or as many as the
    policy picks) it samples the very tokens it samples without."""
    chosen = {name: prompts[name] for name in ("edit", "list")}
    want = seeded_outputs(engine_over(smollm_gguf), chosen, seeds=4, max_tokens=40)
    spec = NGRAM.replace('"fixed"', f'"{draft_length}"')
    engine = engine_over(smollm_gguf, speculative_config=spec)
    assert seeded_outputs(engine, chosen, seeds=4, max_tokens=40) == want
    assert engine.get_stats().spec_num_accepted_tokens > 0
    assert_no_blocks_referenced(engine)


def seeded_outputs(engine, prompts: dict[str, list[int]], seeds: int, max_tokens: int) -> dict[str, list[int]]:
    """Each prompt sampled with seeds 0..seeds-1 (temperature 0.8, top-p 0.95): tokens by request id."""
    for name, ids in prompts.items():
        for seed in range(seeds):
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(f"{name}{seed}", {"prompt_token_ids": ids}, params)
    return {rid: out.outputs[0].token_ids for rid, out in run_to_completion(engine).items()}
