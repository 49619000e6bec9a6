"""KV blocks exported from one engine and imported into another (prefill/decode disaggregation)."""

import pytest
import torch
from conftest import assert_no_blocks_referenced, run_to_completion

from ferry.core.block_hash import hash_prompt_blocks
from ferry.sampling_params import SamplingParams

PROMPT = list(range(1000, 1070))  # 4 full blocks of 16 + 6 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def generate(engine, ids, params=GREEDY):
    engine.add_request("r", {"prompt_token_ids": ids}, params)
    return run_to_completion(engine)["r"].outputs[0].token_ids


@pytest.fixture(scope="module")
def colocated(make_engine):
    return generate(make_engine(), PROMPT)


def test_prefill_here_decode_there_equals_colocated(make_engine, colocated):
    prefill = make_engine()
    first = generate(prefill, PROMPT, SamplingParams(temperature=0, max_tokens=1))  # the prefill side's one token
    assert first == colocated[:1]
    payload = prefill.export_kv(PROMPT)
    assert payload.block_hashes == hash_prompt_blocks(PROMPT, 16) and payload.parent_hash is None
    decode = make_engine()
    assert decode.import_kv(payload) == 4
    assert_no_blocks_referenced(decode)  # imported blocks are cached, not held
    assert generate(decode, PROMPT) == colocated
    assert decode.get_stats().prefix_cache_hits == 64  # only the last 6 tokens were computed there
    assert decode.import_kv(payload) == 0  # already there: nothing written twice


def test_blocks_the_receiver_holds_are_not_sent(make_engine, colocated):
    prefill = make_engine()
    generate(prefill, PROMPT, SamplingParams(temperature=0, max_tokens=1))
    decode = make_engine()
    generate(decode, PROMPT[:40], SamplingParams(temperature=0, max_tokens=1))  # caches blocks 0 and 1
    held = set(hash_prompt_blocks(PROMPT, 16)[:2])
    payload = prefill.export_kv(PROMPT, skip=held)
    assert payload.num_blocks == 2 and payload.parent_hash == hash_prompt_blocks(PROMPT, 16)[1]
    assert len(payload.data) == 2 * 30 * 2 * 16 * 3 * 64 * 4  # blocks x layers x K/V x tokens x heads x dim x fp32
    assert decode.import_kv(payload) == 2
    assert generate(decode, PROMPT) == colocated


def test_export_stops_at_the_first_evicted_block_and_bad_payloads_change_nothing(make_engine):
    prefill = make_engine()
    assert prefill.export_kv(PROMPT).num_blocks == 0  # never prefilled: nothing cached
    generate(prefill, PROMPT, SamplingParams(temperature=0, max_tokens=1))
    payload = prefill.export_kv(PROMPT)
    decode = make_engine()
    free = decode.kv.pool.num_free_blocks
    bad = payload.__class__(**{**{f: getattr(payload, f) for f in payload.__struct_fields__}, "head_dim": 32})
    with pytest.raises(ValueError, match="do not fit this cache"):
        decode.import_kv(bad)
    short = payload.__class__(**{**{f: getattr(payload, f) for f in payload.__struct_fields__}, "data": b"x"})
    with pytest.raises(ValueError, match="bytes, expected"):
        decode.import_kv(short)
    assert decode.kv.pool.num_free_blocks == free and not decode.kv.pool.cached


def test_import_into_a_bf16_cache_converts(make_engine, colocated):
    prefill = make_engine()
    generate(prefill, PROMPT, SamplingParams(temperature=0, max_tokens=1))
    decode = make_engine(kv_cache_dtype="bfloat16")
    assert decode.import_kv(prefill.export_kv(PROMPT)) == 4
    assert decode.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert generate(decode, PROMPT) == colocated  # SmolLM2's greedy path survives bf16 KV (see test_llm_engine)


def core_tokens(engine, request) -> list[int]:
    """Drive the engine core directly; every token it emits for the request, in order."""
    engine.core.add_request(request)
    tokens = []
    while engine.core.has_unfinished_requests():
        for out in engine.core.step():
            tokens += out.new_token_ids
    return tokens


def test_a_request_continues_from_the_token_its_prefill_worker_sampled(make_engine, colocated):
    from ferry.engine.messages import EngineCoreRequest

    prefill = make_engine()
    generate(prefill, PROMPT, SamplingParams(temperature=0, max_tokens=1))
    decode = make_engine()
    decode.import_kv(prefill.export_kv(PROMPT))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    request = EngineCoreRequest("r", PROMPT, params, 12, prefilled_token_ids=colocated[:1])
    assert core_tokens(decode, request) == colocated  # the given token first, then the rest
    assert decode.get_stats().prefix_cache_hits == 64
    # A prefilled token that ends the request (max_tokens 1) finishes it without a step.
    request = EngineCoreRequest("one", PROMPT, SamplingParams(temperature=0, max_tokens=1), 1,
                                prefilled_token_ids=[7])  # fmt: skip
    decode.core.add_request(request)
    outs = decode.core.step()
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([7], "length")]
    assert not decode.core.has_unfinished_requests()
    assert_no_blocks_referenced(decode)


def test_int8_in_transit_bounds_the_error_and_keeps_greedy_output(make_engine, colocated):
    from ferry.kv_transfer.blocks import KVBlocks, export_blocks

    prefill = make_engine()
    generate(prefill, PROMPT, SamplingParams(temperature=0, max_tokens=1))
    hashes = hash_prompt_blocks(PROMPT, 16)
    raw = export_blocks(prefill.kv, prefill.runner.kv_caches, hashes)
    q = export_blocks(prefill.kv, prefill.runner.kv_caches, hashes, encoding="int8")
    assert q.encoding == "int8" and q.num_bytes == raw.num_bytes // 4 + raw.num_bytes // 64  # int8 + a scale per 64
    ref, got = raw.values(), q.values()
    # Round to nearest: at most half a quantization step of each (token, head) vector's largest value.
    step = ref.abs().amax(-1, keepdim=True) / 127
    assert ((got - ref).abs() <= step / 2 + 1e-7).all()
    # Split into single blocks (a store's unit), joined back, sliced: the same bytes.
    assert KVBlocks.join(q.split()) == q
    assert q.tail(1).block_hashes == hashes[1:] and q.tail(1).parent_hash == hashes[0]
    assert KVBlocks.join(q.split()[1:]).data == q.tail(1).data
    decode = make_engine()
    assert decode.import_kv(q) == 4
    assert generate(decode, PROMPT) == colocated


@pytest.mark.parametrize(
    "spec",
    [
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "draft_length": "fixed"}',
        '{"method": "early_exit", "draft_layers": 26, "num_speculative_tokens": 4, "draft_length": "fixed"}',
    ],
    ids=["ngram", "early_exit"],
)
def test_a_speculating_decode_worker_continues_a_transferred_prefill(make_engine, spec):
    """PD with speculation on the decode worker: it imports the prefill worker's blocks, takes the
    token the prefill side sampled, then verifies n-gram drafts, or early exit's (drafted into the
    imported blocks' request, never prefilling the prompt again); the output is the colocated one
    and no block is left referenced."""
    from ferry.engine.messages import EngineCoreRequest

    prompt = list(range(1000, 1035)) * 2  # 70 tokens that repeat: drafts to find
    want = generate(make_engine(), prompt)
    prefill = make_engine()
    assert generate(prefill, prompt, SamplingParams(temperature=0, max_tokens=1)) == want[:1]
    decode = make_engine(speculative_config=spec)
    assert decode.import_kv(prefill.export_kv(prompt)) == 4
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    request = EngineCoreRequest("r", prompt, params, 12, prefilled_token_ids=want[:1])
    assert core_tokens(decode, request) == want
    stats = decode.get_stats()
    assert stats.prefix_cache_hits == 64 and stats.spec_num_draft_tokens > 0
    if "early_exit" in spec:  # (SmolLM2's first 26 layers guess none of these 12 tokens)
        assert decode.core.proposer.draft_model.num_reused_rows > stats.spec_num_draft_tokens
    else:
        assert stats.spec_num_accepted_tokens > 0  # drafts were kept
    assert_no_blocks_referenced(decode)
