"""Structured output through whole engine steps on the real SmolLM2: sampled JSON follows its
schema, regex / choice / Lark outputs match, greedy output is the same alone, batched under
preemption, with speculative decoding and continued from a prefill worker's token; a request
waiting for its grammar holds up no one and can be aborted; bad specs change nothing.

The greedy-equality tests run the fp32 model (`quantization="none"`), as the PD-vs-colocated ones do:
with GGUF blocks each matmul rounds its activations to int8, so the paths' last-bit differences (a
prefix read from the cache or computed in the chunk, a preempted request's tokens recomputed as a
prompt) can move a logit by 0.02-0.1 and turn a near tie into another token. On an AVX2-only EPYC a
prompt's first logprobs moved by up to 0.12 with its first 16 tokens' K/V cached, against 6e-6 in
fp32, and a 0.014 margin flipped."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
from conftest import assert_no_blocks_referenced, engine_over, run_to_completion

from ferry.engine.messages import EngineCoreRequest
from ferry.sampling_params import InvalidParameterError, SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999999},  # bounded: CI saw 150 sampled digits
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                               "qty": {"type": "number", "minimum": 0.5, "maximum": 10, "multipleOf": 0.5}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "note": {"type": "string", "maxLength": 16},
    },
    "required": ["id", "items"],
    "additionalProperties": False,
}  # fmt: skip
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high", None]}},
         "required": ["ok", "level"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def engine(smollm_gguf):
    return engine_over(smollm_gguf)


def chat_ids(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok.encode(rendered, add_special_tokens=False)


def run(engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for name, ids in prompts.items():
        engine.add_request(name, {"prompt_token_ids": ids}, params)
    return run_to_completion(engine)


def test_sampled_json_follows_its_schema(engine):
    prompts = {
        "person": (chat_ids(engine, "Describe a person as JSON: name, age, pets."), PERSON),
        "order": (chat_ids(engine, "Write a shop order as JSON."), ORDER),
        "flags": (chat_ids(engine, "Give me status flags as JSON."), FLAGS),
    }
    for name, (ids, schema) in prompts.items():
        params = SamplingParams(n=4, temperature=0.8, max_tokens=160,
                                structured_outputs=StructuredOutputsParams(json=schema))  # fmt: skip
        engine.add_request(name, {"prompt_token_ids": ids}, params)
    done = run_to_completion(engine)
    for name, (_, schema) in prompts.items():
        for c in done[name].outputs:
            assert c.finish_reason == "stop", (name, c.text)
            jsonschema.validate(json.loads(c.text), schema)
    assert_no_blocks_referenced(engine)


def test_regex_choice_and_lark_outputs_match(engine):
    cases = {
        "phone": (StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"), r"\(\d{3}\) \d{3}-\d{4}"),
        "capital": (StructuredOutputsParams(choice=["Paris", "Rome", "Madrid"]), r"Paris|Rome|Madrid"),
        "sum": (StructuredOutputsParams(grammar='start: NUM " + " NUM " = " NUM\nNUM: /[0-9]{1,3}/'),
                r"[0-9]{1,3} \+ [0-9]{1,3} = [0-9]{1,3}"),
    }  # fmt: skip
    prompts = {"phone": "Call me at", "capital": "The capital of France is", "sum": "Some arithmetic:"}
    for name, (spec, _) in cases.items():
        ids = engine.tokenizer.encode(prompts[name])
        engine.add_request(name, {"prompt_token_ids": ids}, SamplingParams(n=3, temperature=0.8, max_tokens=40,
                                                                           structured_outputs=spec))  # fmt: skip
    done = run_to_completion(engine)
    for name, (_, pattern) in cases.items():
        for c in done[name].outputs:
            assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), (name, c.text)


def greedy(schema=PERSON, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema),
                          **kw)  # fmt: skip


@pytest.fixture(scope="module")
def fp32_engine(smollm):
    return engine_over(smollm)


@pytest.fixture(scope="module")
def reference(fp32_engine):
    """Each prompt's greedy structured output, alone, on the fp32 model."""
    engine = fp32_engine
    texts = {"a": "A person as JSON.", "b": "Invent a character, as JSON.", "c": "JSON for a pet owner."}
    prompts = {name: chat_ids(engine, t) for name, t in texts.items()}
    out = {name: run(engine, {name: ids}, greedy())[name].outputs[0].token_ids for name, ids in prompts.items()}
    return prompts, out


def test_greedy_is_the_same_batched_under_preemption(smollm, reference):
    prompts, expected = reference
    small = engine_over(smollm, num_kv_blocks=12, block_size=16)  # ~190 tokens for three ~70-token runs
    done = run(small, prompts, greedy())
    assert small.get_stats().num_preemptions > 0
    assert {name: done[name].outputs[0].token_ids for name in prompts} == expected
    assert_no_blocks_referenced(small)


@pytest.fixture(scope="module")
def spec(smollm):
    return engine_over(smollm, speculative_config='{"method": "ngram", "num_speculative_tokens": 4, '
                                                       '"prompt_lookup_min": 2, "draft_length": "fixed"}')  # fmt: skip


def test_greedy_is_the_same_with_speculative_decoding(spec, reference):
    prompts, expected = reference
    done = run(spec, prompts, greedy())
    assert {name: done[name].outputs[0].token_ids for name in prompts} == expected
    assert spec.get_stats().spec_num_draft_tokens > 0
    assert_no_blocks_referenced(spec)


def test_a_prefill_workers_token_advances_the_grammar(smollm):
    """Disaggregation: the decode side continues from the token the prefill worker sampled (which
    obeyed the grammar there) and the grammar it reaches must have consumed that token. On the fp32
    model (`quantization="none"`), as the other PD-vs-colocated equality tests: there the prompt path
    computes the prefilled token's K/V (the colocated run, the decode step), and with GGUF blocks the
    int8 activation dots after attention can turn the two paths' rounding into another greedy token."""
    engine = engine_over(smollm)
    ids = chat_ids(engine, "A person as JSON.")
    want = run(engine, {"a": ids}, greedy())["a"].outputs[0].token_ids
    params = greedy()
    params.max_tokens = None
    core = engine.core
    core.add_request(EngineCoreRequest("pd", ids, params, 120, prefilled_token_ids=want[:1]))
    tokens, finish = [], None
    while finish is None:
        for out in core.step():
            if out.request_id == "pd":
                tokens += out.new_token_ids
                finish = out.finish_reason
    assert tokens == want and finish == "stop"
    assert_no_blocks_referenced(engine)


def test_a_request_waiting_for_its_grammar_holds_up_no_one(fp32_engine, reference, monkeypatch):
    prompts, expected = reference
    engine = fp32_engine
    compiler = engine.core.grammars
    real_submit = compiler.submit
    pending: list[Future] = []

    def slow_submit(params):  # the compile thread has not finished yet
        pending.append(Future())
        return pending[-1]

    monkeypatch.setattr(compiler, "submit", slow_submit)
    engine.add_request("waits", {"prompt_token_ids": prompts["a"]}, greedy())
    engine.add_request("aborted", {"prompt_token_ids": prompts["b"]}, greedy())
    engine.add_request("free", {"prompt_token_ids": prompts["c"]}, SamplingParams(temperature=0.0, max_tokens=8))
    done = {}
    for _ in range(20):  # the unconstrained request runs to its end meanwhile
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert "free" in done and len(done["free"].outputs[0].token_ids) == 8
    assert not {"waits", "aborted"} & engine.core.scheduler.requests.keys()
    engine.abort_request("aborted")
    assert_no_blocks_referenced(engine)
    pending[1].set_result(real_submit(greedy().structured_outputs).result(timeout=60))  # too late: dropped
    pending[0].set_result(real_submit(greedy().structured_outputs).result(timeout=60))
    done = run_to_completion(engine)
    assert set(done) == {"waits"} and done["waits"].outputs[0].token_ids == expected["a"]
    assert_no_blocks_referenced(engine)


def test_a_bad_spec_changes_nothing(engine):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-"))
    with pytest.raises(InvalidParameterError) as e:
        engine.add_request("bad", {"prompt_token_ids": [1, 2, 3]}, params)
    assert e.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests()


def test_a_grammar_opens_after_its_marker(engine, spec):
    """A reasoning model's grammar applies after `</think>` (after_token_ids): the tokens up to the
    marker are the free greedy ones, then the answer follows the grammar and ends it. With drafts
    (n-gram speculation) the output is the same."""
    ids = chat_ids(engine, "Is the sky blue? Say why, then answer yes or no. The sky, the sky, the sky.")
    free = run(engine, {"free": ids}, SamplingParams(temperature=0.0, max_tokens=24))["free"].outputs[0].token_ids
    marker = free[4:6]  # two tokens the model writes unconstrained
    end = next(i for i in range(len(free)) if free[i : i + 2] == marker) + 2
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        choice=[" yes", " no", " maybe so"], after_token_ids=marker))  # fmt: skip
    for eng in (engine, spec):
        out = run(eng, {"gated": ids}, params)["gated"].outputs[0]
        assert out.token_ids[:end] == free[:end], eng
        answer = eng.tokenizer.decode(out.token_ids[end:])
        assert out.finish_reason == "stop" and answer in (" yes", " no", " maybe so"), answer
        assert_no_blocks_referenced(eng)
    never = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        structured_outputs=StructuredOutputsParams(choice=[" yes"], after_token_ids=[engine.tokenizer.vocab_size - 1]),
    )  # a marker never written: all free
    assert run(engine, {"never": ids}, never)["never"].outputs[0].token_ids == free
