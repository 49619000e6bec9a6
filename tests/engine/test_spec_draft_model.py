"""Speculative decoding with a draft model and with early exit (the target's first layers), through
whole engine steps on the real SmolLM2: greedy output is token-exact with speculation off, alone
and batched, under preemption, with a warm prefix cache, with a draft that is always wrong (a tiny
random model with the same vocabulary) and one that is right (the target itself); never a token
past max_tokens or a stop token; every block of both caches freed after finish and abort. At
temperature 1 the tokens follow the target's distribution (chi-squared), and seeded requests
sample the same tokens as without speculation."""

from __future__ import annotations

import copy

import pytest
import test_spec_decode_engine
from conftest import assert_no_blocks_referenced, engine_over, run_to_completion, tiny_llama
from test_spec_decode_engine import assert_second_token_follows_the_model, seeded_outputs, spec_prompts

from ferry.sampling_params import SamplingParams
from ferry.worker.model_loading import LoadedModel
from ferry.worker.spec_decode.early_exit import EarlyExitProposer


def spec(method: str, k: int = 4, length: str = "fixed", **extra) -> str:
    """A speculative_config; "fixed" verifies every draft, whatever the adaptive policy would pick."""
    keys = {"draft_model": '"model": "draft"', "early_exit": '"draft_layers": 24'}[method]
    more = "".join(f', "{key}": {value}' for key, value in extra.items())
    return f'{{"method": "{method}", {keys}, "num_speculative_tokens": {k}, "draft_length": "{length}"{more}}}'


def generate(engine, prompts: dict[str, list[int]], max_tokens: int = 40, **params) -> dict[str, list[int]]:
    """Greedy tokens per prompt. 40, not the n-gram tests' 48: the story's 48th token is a near tie
    (logprobs -1.1706 and -1.1748) that a recomputation after preemption, through the prompt
    path's exact dots rather than the decode rows' int8 dots, may flip with or without drafts."""
    return test_spec_decode_engine.generate(engine, prompts, max_tokens, **params)


@pytest.fixture(scope="module")
def prompts(smollm):
    return spec_prompts(smollm.tokenizer)


@pytest.fixture(scope="module")
def reference(smollm_gguf, prompts):
    engine = engine_over(smollm_gguf)
    return {name: generate(engine, {name: ids})[name] for name, ids in prompts.items()}


@pytest.fixture(scope="module")
def wrong_draft(smollm):
    """A tiny random model over SmolLM2's vocabulary and tokenizer: its drafts are noise."""
    tiny = tiny_llama(vocab_size=smollm.model.config.vocab_size)
    return LoadedModel(tiny, smollm.tokenizer, smollm.device, smollm.dtype, "tiny-random")


def assert_all_freed(engine) -> None:
    assert_no_blocks_referenced(engine)
    drafter = engine.core.proposer.draft_model
    if isinstance(drafter, EarlyExitProposer):  # drafts in the target's blocks: nothing of its own
        assert drafter.kv is engine.core.scheduler.kv and not drafter.states
        return
    assert not drafter.shadows and not drafter.kv.req_blocks
    assert drafter.kv.pool.num_free_blocks == drafter.kv.pool.num_blocks


@pytest.mark.parametrize("method", ["draft_model", "early_exit"])
def test_greedy_is_token_exact_alone_batched_and_preempted(smollm_gguf, prompts, reference, method):
    draft = smollm_gguf if method == "draft_model" else None  # the target drafting for itself
    engine = engine_over(smollm_gguf, draft_model=draft, speculative_config=spec(method))
    assert generate(engine, {"edit": prompts["edit"]}) == {"edit": reference["edit"]}
    stats = engine.get_stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert generate(engine, prompts) == reference
    assert_all_freed(engine)
    if method == "early_exit":  # verified from the draft's streams: only the last 6 layers ran for them
        assert engine.core.proposer.draft_model.num_reused_rows > stats.spec_num_draft_tokens
    # 12 blocks of 16 tokens cannot hold the three sequences at once: some are preempted (and
    # their draft shadows freed, then rebuilt from the draft's prefix cache).
    engine = engine_over(smollm_gguf, draft_model=draft, speculative_config=spec(method), num_kv_blocks=12)
    assert generate(engine, prompts) == reference
    assert engine.get_stats().num_preemptions > 0
    assert_all_freed(engine)


def test_early_exit_verifies_beside_a_prompt(smollm_gguf, prompts, reference):
    """A step with a request verifying from early exit's streams and another request's prompt runs
    the first through the last layers only and the second through the whole model (two forwards,
    sampled together): each gets the tokens it gets alone, without speculation."""
    engine = engine_over(smollm_gguf, speculative_config=spec("early_exit"))
    runner, drafter = engine.core.runner, engine.core.proposer.draft_model
    beside_others = []
    from_streams = runner._execute_from_streams

    def spy(sched, record, streams):
        beside_others.append(len(streams) < len(sched.scheduled))
        return from_streams(sched, record, streams)

    runner._execute_from_streams = spy
    params = SamplingParams(temperature=0.0, max_tokens=40)
    engine.add_request("edit", {"prompt_token_ids": prompts["edit"]}, params)
    while not drafter.states:
        engine.step()
    engine.add_request("story", {"prompt_token_ids": prompts["story"]}, params)
    done = run_to_completion(engine)
    assert {name: done[name].outputs[0].token_ids for name in done} == {n: reference[n] for n in ("edit", "story")}
    assert any(beside_others) and drafter.num_reused_rows > 0
    assert_all_freed(engine)


def test_draft_always_wrong_or_right(smollm, smollm_gguf, prompts, reference, wrong_draft):
    """A random draft's tokens are almost all rejected, the target's own (fp32, drafting for
    itself) almost all kept; the output is the model's own either way."""
    engine = engine_over(smollm_gguf, draft_model=wrong_draft, speculative_config=spec("draft_model"))
    assert generate(engine, {"edit": prompts["edit"]}) == {"edit": reference["edit"]}
    stats = engine.get_stats()
    assert stats.spec_num_draft_tokens > 100 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens // 10
    assert_all_freed(engine)

    want = generate(engine_over(smollm), prompts)
    engine = engine_over(smollm, draft_model=smollm, speculative_config=spec("draft_model"))
    assert generate(engine, prompts) == want
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens > 0
    assert_all_freed(engine)


def test_warm_prefix_cache_limits_and_abort(smollm_gguf, prompts, reference):
    """The draft's cache shares prefixes as the target's does; max_tokens and stop tokens end a
    request where they would without speculation; an aborted request's draft blocks are freed."""
    engine = engine_over(smollm_gguf, draft_model=smollm_gguf, speculative_config=spec("draft_model"))
    ids, want = prompts["edit"], reference["edit"]
    assert generate(engine, {"edit": ids}) == {"edit": want}
    drafter = engine.core.proposer.draft_model
    assert drafter.kv.prefix_hits == 0
    assert generate(engine, {"edit": ids}) == {"edit": want}
    assert drafter.kv.prefix_hits >= len(ids) // 16 * 16 - 16  # the prompt's full blocks, but the last
    for n in (1, 2, 7):
        assert generate(engine, {"edit": ids}, max_tokens=n)["edit"] == want[:n]
    stop = want[9]
    assert generate(engine, {"edit": ids}, stop_token_ids=[stop])["edit"] == want[: want.index(stop) + 1]
    assert_all_freed(engine)

    engine.add_request("a", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=40))
    while not drafter.shadows:
        engine.step()
    engine.step()
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert_all_freed(engine)


def test_a_prompt_sharing_a_drafting_requests_last_block_reads_it_whole(smollm_gguf, prompts):
    """Request a's last token fills a block; scheduling a's verify publishes that block, and a prompt
    admitted in the same step (b: a's tokens and three more) hits it. The verify's last layers must
    write the token's K/V before b's prompt attends to it: its slot in those layers is poisoned (NaN,
    as a block's previous owner could have left anything there) before the step, and b's tokens
    must be those of an engine without speculation at the same point."""
    exit_at = 24

    def run(speculative: bool, length: int | None = None) -> tuple[list[int], int]:
        engine = engine_over(smollm_gguf, **({"speculative_config": spec("early_exit")} if speculative else {}))
        engine.add_request("a", {"prompt_token_ids": prompts["edit"]}, SamplingParams(temperature=0.0, max_tokens=80))
        a = engine.core.scheduler.requests["a"]
        while True:
            engine.step()
            assert a.num_output_tokens < 80, "a never stopped with its last token at a block's end"
            at_block_end = a.num_tokens % 16 == 0 and a.num_computed_tokens == a.num_tokens - 1
            if speculative and at_block_end and "a" in engine.core.proposer.draft_model.states:
                break
            if not speculative and a.num_tokens == length:
                break
        if speculative:
            p = a.num_tokens - 1
            slot = engine.kv.block_ids("a")[p // 16] * 16 + p % 16
            for k, v in engine.core.runner.kv_caches[exit_at:]:
                k.view(-1, *k.shape[2:])[slot] = float("nan")
                v.view(-1, *v.shape[2:])[slot] = float("nan")
        length = a.num_tokens
        engine.add_request("b", {"prompt_token_ids": a.all_token_ids + [11, 12, 13]},
                           SamplingParams(temperature=0.0, max_tokens=8))  # fmt: skip
        done = run_to_completion(engine)
        assert done["b"].num_cached_tokens == length  # a's every block, the one its last token fills too
        return done["b"].outputs[0].token_ids, length

    got, length = run(speculative=True)
    want, _ = run(speculative=False, length=length)
    assert got == want


def test_early_exit_limits_n_and_abort(smollm_gguf, prompts, reference):
    """Early exit over the target's cache: max_tokens and stop tokens end a request where they would
    without speculation (the slots its drafts took are the request's, freed with it), n = 2 siblings
    decode alike, and an abort between a proposal and its verification drops the streams."""
    engine = engine_over(smollm_gguf, speculative_config=spec("early_exit"))
    drafter = engine.core.proposer.draft_model
    ids, want = prompts["edit"], reference["edit"]
    for n in (1, 2, 7):
        assert generate(engine, {"edit": ids}, max_tokens=n)["edit"] == want[:n]
    stop = want[9]
    assert generate(engine, {"edit": ids}, stop_token_ids=[stop])["edit"] == want[: want.index(stop) + 1]
    engine.add_request("pair", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=40, n=2))
    done = run_to_completion(engine)
    assert [c.token_ids for c in done["pair"].outputs] == [want, want]
    assert_all_freed(engine)

    engine.add_request("a", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=40))
    while not drafter.states:
        engine.step()
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert_all_freed(engine)


def test_sampling_keeps_the_models_distribution(smollm_gguf):
    """Temperature 1, unseeded, drafts from the target's first 24 layers: over 500 requests the
    token after the most common first token follows the model's own distribution there (its top
    20 probabilities, the rest pooled) by a chi-squared test at 0.1%, with drafts kept and
    rejected (500 fail the bias test_spec_decode_engine.py names as surely as 1000 do)."""
    n = 500
    ids = smollm_gguf.tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1,")
    engine = engine_over(smollm_gguf, max_num_seqs=256, speculative_config=spec("early_exit", k=2))
    for i in range(n):
        engine.add_request(f"s{i}", {"prompt_token_ids": ids}, SamplingParams(temperature=1.0, max_tokens=3))
    done = run_to_completion(engine)
    stats = engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_all_freed(engine)
    assert_second_token_follows_the_model(smollm_gguf, ids, [done[f"s{i}"].outputs[0].token_ids for i in range(n)])


def test_seeded_sampling_is_token_exact_with_speculation_off(smollm_gguf, prompts):
    chosen = {name: prompts[name] for name in ("edit", "story")}
    want = seeded_outputs(engine_over(smollm_gguf), chosen, seeds=3, max_tokens=30)
    engine = engine_over(
        smollm_gguf, draft_model=smollm_gguf, speculative_config=spec("draft_model", length="adaptive")
    )
    assert seeded_outputs(engine, chosen, seeds=3, max_tokens=30) == want
    stats = engine.get_stats()
    # The target drafting for itself, with the noise its verification uses: drafts are nearly
    # always kept (drawn independently, two draws at this temperature would often differ).
    assert stats.spec_num_accepted_tokens >= 0.85 * stats.spec_num_draft_tokens > 0
    assert_all_freed(engine)


def test_bad_draft_configs_are_clear_errors(smollm, wrong_draft):
    for bad, words in (
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "need a `model`"),
        ('{"method": "ngram", "model": "x", "num_speculative_tokens": 2}', "only they take one"),
        ('{"method": "early_exit", "num_speculative_tokens": 2}', "draft_layers"),
        ('{"method": "ngram", "draft_layers": 3, "num_speculative_tokens": 2}', "draft_layers is for"),
        ('{"method": "early_exit", "draft_layers": 30, "num_speculative_tokens": 2}', r"\[1, 29\]"),
    ):
        with pytest.raises(ValueError, match=words):
            engine_over(smollm, speculative_config=bad)
    other_tokenizer = copy.deepcopy(smollm.tokenizer)
    other_tokenizer.add_tokens(["<not-in-the-target>"])
    for draft, words in (
        (wrong_draft._replace(tokenizer=other_tokenizer), "tokenizer"),
        (LoadedModel(tiny_llama(), None, smollm.device, smollm.dtype, "tiny"), "vocabulary"),
    ):
        with pytest.raises(ValueError, match=words):
            engine_over(smollm, draft_model=draft, speculative_config=spec("draft_model"))
