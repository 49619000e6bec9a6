"""The step API on the real SmolLM2: validation, abort, n > 1, seeds, stops, logprobs, stats."""

import msgspec
import pytest
import torch
from conftest import assert_no_blocks_referenced, run_to_completion

from ferry.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. Then the dog"


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_model_len=256)


@pytest.fixture(scope="module")
def greedy_ref(engine):
    engine.add_request("ref", PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    out = run_to_completion(engine)["ref"].outputs[0]
    return out.token_ids, out.text


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ("word " * 300, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [1, 2, 10**6]}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": [1, -3]}, SamplingParams(), "prompt_token_ids"),
        ("hi", dict(max_tokens=0), "max_tokens"),
        ("hi", dict(max_tokens=-2), "max_tokens"),
        ("hi", dict(temperature=-0.1), "temperature"),
        ("hi", dict(top_p=0.0), "top_p"),
        ("hi", dict(top_p=1.5), "top_p"),
        ("hi", dict(n=0), "n"),
        ("hi", dict(stop_token_ids=[10**7]), "stop_token_ids"),
    ],
)
def test_bad_input_is_a_value_error_and_engine_keeps_serving(engine, greedy_ref, prompt, params, field):
    engine.add_request("good", PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    with pytest.raises(ValueError, match=field):
        p = SamplingParams(**params) if isinstance(params, dict) else params
        engine.add_request("bad", prompt, p)
    done = run_to_completion(engine)
    assert set(done) == {"good"}
    assert done["good"].outputs[0].token_ids == greedy_ref[0]
    assert_no_blocks_referenced(engine)


def test_abort_any_time_frees_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", PROMPT * 3, params)
    engine.add_request("b", PROMPT, params)
    engine.add_request("c", PROMPT + " waits", params)
    engine.step()
    assert engine.kv.pool.num_referenced() > 0
    engine.abort_request("a")  # running
    for _ in range(3):
        engine.step()
    engine.abort_request(["b", "c", "never-existed"])
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert_no_blocks_referenced(engine)


def test_n_sequences_share_prompt_blocks(engine):
    ids = engine.tokenizer.encode(PROMPT * 3)
    full_blocks = len(ids) // 16
    engine.kv.pool.reset_prefix_cache()
    engine.add_request("n", {"prompt_token_ids": ids}, SamplingParams(n=3, seed=5, max_tokens=8, temperature=1.0))
    engine.step()
    shared = [b for b in engine.kv.req_blocks["n#0"][:full_blocks]]
    assert all(b.ref_cnt == 3 for b in shared)
    assert engine.kv.req_blocks["n#1"][:full_blocks] == shared
    stats = engine.get_stats()
    done = run_to_completion(engine)["n"]
    assert [o.index for o in done.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in done.outputs)
    assert len({tuple(o.token_ids) for o in done.outputs}) > 1  # seeds 5, 6, 7 differ
    assert stats.prefix_cache_hits >= 2 * full_blocks * 16
    assert_no_blocks_referenced(engine)


def test_seeded_sampling_same_in_any_batch(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    engine.add_request("alone", PROMPT, params)
    alone = run_to_completion(engine)["alone"].outputs[0].token_ids
    engine.add_request("x", "Something else entirely, with more words", SamplingParams(temperature=1.0, max_tokens=20))
    engine.add_request("y", "Short", SamplingParams(temperature=0.5, seed=9, max_tokens=5))
    engine.step()
    engine.add_request("seeded", PROMPT, params)
    engine.add_request("z", PROMPT, SamplingParams(temperature=1.0, max_tokens=16))
    done = run_to_completion(engine)
    assert done["seeded"].outputs[0].token_ids == alone


def test_stop_string_across_token_boundary(engine, greedy_ref):
    ids, text = greedy_ref
    tok = engine.tokenizer
    # A stop string made of the end of token 5 and the start of token 6.
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    a, b = pieces[4], pieces[5]
    assert len(a) >= 2 and len(b) > len(a) + 1
    stop = a[-2:] + b[len(a) : len(a) + 2]
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop], output_kind=RequestOutputKind.DELTA)
    engine.add_request("s", PROMPT, params)
    # Stop strings are matched where text is: the core's copy (and the API -> core wire) has none.
    assert engine.core.scheduler.requests["s"].sampling_params.stop == []
    wire = msgspec.msgpack.encode(engine.input_processor.process("w", PROMPT, params).core_requests)
    assert stop.encode() not in wire
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
            if out.finished:
                final = out.outputs[0]
    expected = text[: text.index(stop)]
    assert "".join(deltas) == expected
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert stop not in "".join(deltas)
    engine.add_request(
        "s2", PROMPT, params.clone(include_stop_str_in_output=True, output_kind=RequestOutputKind.FINAL_ONLY)
    )
    assert run_to_completion(engine)["s2"].outputs[0].text == text[: text.index(stop) + len(stop)]
    assert_no_blocks_referenced(engine)


def test_stop_strings_count_only_after_min_tokens(engine, greedy_ref):
    """As in vLLM: with min_tokens, a stop string must end in the text after the first min_tokens
    tokens' (it stopped the request at its second token before)."""
    ids, text = greedy_ref
    tok = engine.tokenizer
    stop = text[len(tok.decode(ids[:1])) : len(tok.decode(ids[:2]))]  # the second token's text
    floor = len(tok.decode(ids[:3]))
    at = text.find(stop, floor - len(stop) + 1)
    for rid, min_tokens, want in (("early", 0, text[: text.index(stop)]), ("late", 3, text if at < 0 else text[:at])):
        engine.add_request(rid, PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                       min_tokens=min_tokens))  # fmt: skip
        assert run_to_completion(engine)[rid].outputs[0].text == want, rid
    assert_no_blocks_referenced(engine)


def test_stop_token_ids_max_tokens_and_logprobs(engine, greedy_ref):
    ids, _ = greedy_ref
    engine.add_request("t", PROMPT, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[2]]))
    out = run_to_completion(engine)["t"].outputs[0]
    assert out.token_ids == ids[:3] and out.finish_reason == "stop" and out.stop_reason == ids[2]
    tok = engine.tokenizer  # the stop token is an id, not text (vLLM's), unless asked for
    assert out.text == tok.decode(ids[:2])
    engine.add_request("t2", PROMPT, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[2]],
                                                    include_stop_str_in_output=True))  # fmt: skip
    assert run_to_completion(engine)["t2"].outputs[0].text == tok.decode(ids[:3])
    engine.add_request("m", PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=3))
    out = run_to_completion(engine)["m"].outputs[0]
    assert out.token_ids == ids[:5] and out.finish_reason == "length"
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry[tok].rank == 1 and len(entry) == 3  # greedy token is the top-1
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_stats_while_running(engine):
    for i in range(3):
        engine.add_request(f"q{i}", PROMPT * 2, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    s0 = engine.get_stats()
    assert s0.num_waiting == 3 and s0.num_running == 0
    engine.step()
    s1 = engine.get_stats()
    assert s1.num_running == 3 and s1.kv_cache_usage > 0
    run_to_completion(engine)
    s2 = engine.get_stats()
    assert s2.num_running == 0 and s2.kv_cache_usage == 0.0
    # q1 and q2 share q0's first full block, published when q0 was scheduled in the same step.
    assert s2.prefix_cache_hits - s0.prefix_cache_hits >= 2 * 16


def test_request_id_collisions_are_rejected_without_side_effects(engine):
    params = SamplingParams(temperature=0, max_tokens=2, n=2)
    engine.add_request("dup", PROMPT, params)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup#1", PROMPT, SamplingParams(max_tokens=2))  # a child's id
    done = run_to_completion(engine)
    assert list(done) == ["dup"] and len(done["dup"].outputs) == 2
    assert not engine.output_processor.requests and not engine.output_processor.seq_to_request
    assert_no_blocks_referenced(engine)


def test_a_finished_childs_id_stays_taken_until_its_request_ends(engine):
    """x#0 done while x#1 runs: a new request named "x#0" would have taken x#0's place in the output
    processor (aborting x then aborted it, and its output never came)."""
    stops = list(range(0, 49152, 3))  # a third of the vocabulary ends a sequence: the two end apart
    for seed in range(40):
        engine.add_request("x", PROMPT, SamplingParams(temperature=1.0, max_tokens=30, n=2, seed=seed,
                                                       stop_token_ids=stops))  # fmt: skip
        while engine.has_unfinished_requests() and {"x#0", "x#1"} <= engine.scheduler.requests.keys():
            engine.step()
        if engine.scheduler.requests.keys() == {"x#1"}:
            break
        run_to_completion(engine)
    else:
        pytest.fail("no seed in 40 finished x#0 before x#1")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("x#0", PROMPT, SamplingParams(max_tokens=2))
    engine.abort_request("x")
    assert not engine.has_unfinished_requests() and not engine.output_processor.seq_to_request
    assert_no_blocks_referenced(engine)


def test_bf16_kv_cache_decodes_like_fp32(make_engine, greedy_ref):
    """--kv-cache-dtype bfloat16: the cache is stored in bf16, read by the C++ decode kernel, and
    the 24 greedy tokens are the fp32 cache's (measured; a near-tie could one day flip one)."""
    engine = make_engine(max_model_len=256, kv_cache_dtype="bfloat16")
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == torch.bfloat16
    assert engine.runner.attn_backend.use_cpu_kernel
    engine.add_request("bf16", PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    out = run_to_completion(engine)["bf16"].outputs[0]
    assert out.token_ids == greedy_ref[0]
    assert_no_blocks_referenced(engine)


def test_without_chunked_prefill_the_step_budget_takes_a_whole_prompt(make_engine):
    """vLLM's default: with chunked prefill off and max_num_batched_tokens unset, a step may take
    max_model_len tokens (a prompt goes whole); set lower, it is an error."""
    from ferry.config import EngineArgs

    assert EngineArgs(enable_chunked_prefill=False, max_model_len=4096).max_num_batched_tokens == 4096
    assert EngineArgs(max_model_len=4096).max_num_batched_tokens == 2048
    engine = make_engine(enable_chunked_prefill=False, num_kv_blocks=300)  # the model's context, capped: 4,800
    assert engine.core.scheduler.max_num_batched_tokens >= engine.info.max_model_len > 2048
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=1000)


def test_max_logprobs_bounds_each_requests_logprobs(engine, make_engine):
    """vLLM's --max-logprobs: 20 unless set, -1 for the whole vocabulary; beyond it a request is
    refused (the field named) before it takes a block."""
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match="logprobs of 21, which is greater than max allowed: 20") as e:
            engine.add_request("many", PROMPT, SamplingParams(max_tokens=1, **{field: 21}))
        assert e.value.param == field
    assert_no_blocks_referenced(engine)
    wide = make_engine(max_model_len=64, max_logprobs=-1, num_kv_blocks=16)
    vocab = wide.core.info.vocab_size
    wide.add_request("all", "Hi", SamplingParams(temperature=0, max_tokens=1, logprobs=vocab))
    (top,) = run_to_completion(wide)["all"].outputs[0].logprobs
    assert len(top) == vocab  # every token's, ranked
    with pytest.raises(ValueError, match=f"max allowed: {vocab}"):
        wide.add_request("more", "Hi", SamplingParams(max_tokens=1, logprobs=vocab + 1))
    with pytest.raises(ValueError, match="max_logprobs must be >= -1"):
        make_engine(max_logprobs=-2)
