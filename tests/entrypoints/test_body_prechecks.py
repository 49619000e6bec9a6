"""Prompt bounds read from a body's bytes (`precheck_raw`), before millions of token ids are built
into Python objects: exact for token ids, silent for anything it cannot count exactly."""

from __future__ import annotations

import asyncio
import json

import pytest

from ferry.entrypoints.openai.protocol import (
    MAX_PROMPTS,
    PRECHECK_RAW_BYTES,
    OpenAIError,
    PromptLimits,
    decode_json_object,
    precheck_body,
    precheck_raw,
)

LIMITS = PromptLimits(max_tokens=2047, max_chars=200_000)


def limits_of(model):
    return LIMITS if model == "m" else None


def body(prompt, **extra) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, **extra}).encode()


def refusal(raw: bytes) -> str:
    with pytest.raises(OpenAIError) as e:
        precheck_raw(raw, limits_of)
    assert e.value.status == 400 and e.value.param == "prompt"
    return e.value.message


def test_token_ids_are_counted_from_the_bytes_as_the_decoded_check_counts_them():
    ids = list(range(1000, 4000)) * 200  # 600,000 ids, 3 MB
    raw = body(ids, max_tokens=2)
    assert len(raw) > PRECHECK_RAW_BYTES
    msg = refusal(raw)
    assert "600000 tokens" in msg
    with pytest.raises(OpenAIError) as decoded:
        precheck_body(decode_json_object(raw), LIMITS)
    assert decoded.value.message == msg  # the same answer as the check on the decoded body
    # Whitespace, as any JSON encoder may put it, changes nothing.
    spaced = b'{"prompt" : [ ' + b" , ".join(b"7" for _ in range(600_000)) + b' ] , "model":"m"}'
    assert "600000 tokens" in refusal(spaced)


def test_lists_of_token_id_lists_are_bounded_in_number_and_in_ids():
    many = body([[1]] * (MAX_PROMPTS + 1) + [[2] * 400_000])
    assert len(many) > PRECHECK_RAW_BYTES
    assert f"at most {MAX_PROMPTS} prompts" in refusal(many)
    # Fewer prompts, but more ids than MAX_PROMPTS contexts: one of them is too long.
    long_ones = body([[5] * (LIMITS.max_tokens + 1)] * MAX_PROMPTS)
    assert len(long_ones) > PRECHECK_RAW_BYTES
    assert "tokens" in refusal(long_ones)


def test_what_cannot_be_counted_exactly_is_left_to_the_decoded_checks():
    big_ok = body([[5] * 1000] * 400)  # 400 prompts of 1,000 ids: within every bound
    assert len(big_ok) > PRECHECK_RAW_BYTES
    precheck_raw(big_ok, limits_of)
    # Text with commas: they are characters, not ids.
    precheck_raw(body("a," * 1_000_000), limits_of)
    precheck_raw(body(["a,b", *[[1] * 10] * 100_000]), limits_of)  # over MAX_PROMPTS, but not countable
    # Unknown model, no prompt, a chat body, malformed JSON, a small body: nothing to say here.
    precheck_raw(json.dumps({"model": "other", "prompt": [1] * 600_000}).encode(), limits_of)
    precheck_raw(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 2_000_000}]}).encode(),
                 limits_of)  # fmt: skip
    precheck_raw(b'{"model": "m", "prompt": [1, 2' + b", 3" * 600_000, limits_of)
    precheck_raw(body([1] * 3000), limits_of)  # over the limit, but small: the decoded check answers


def test_chat_text_the_template_renders_counts_besides_the_content():
    """Tool definitions, a call's arguments, names and reasoning reach the prompt too: a body that
    hides its megabytes there is refused before the template renders and the tokenizer runs."""
    big = "x" * (LIMITS.max_chars + 1)
    ask = [{"role": "user", "content": "hi"}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": big}}
    tool = {"type": "function", "function": {"name": "f", "description": big, "parameters": {"type": "object"}}}
    for data in (
        {"messages": ask, "tools": [tool]},
        {"messages": [*ask, {"role": "assistant", "content": None, "tool_calls": [call]}]},
        {"messages": [*ask, {"role": "assistant", "content": "a", "reasoning_content": big}]},
        {"messages": [{"role": "user", "content": "hi", "name": big}]},
        {"messages": ask, "chat_template_kwargs": {"note": big}},
        {"messages": ask, "tools": [{**tool, "function": {**tool["function"], "description": "d",
                                                           "parameters": {big: {"type": "string"}}}}]},
    ):  # fmt: skip
        with pytest.raises(OpenAIError) as e:
            precheck_body(data, LIMITS)
        assert e.value.status == 400 and e.value.param == "messages", data.keys()
    half = "x" * (LIMITS.max_chars // 2 - 100)  # content and tools together, each under the limit
    with pytest.raises(OpenAIError):
        precheck_body({"messages": [{"role": "user", "content": half}], "tools": [{**tool, "function": {
            **tool["function"], "description": half + "x" * 300}}]}, LIMITS)  # fmt: skip
    deep: list = []
    for _ in range(5000):  # counted without recursion
        deep = [deep]
    precheck_body({"messages": ask, "chat_template_kwargs": {"k": deep}}, LIMITS)
    precheck_body({"messages": [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {"name": "f", "arguments": "{}"}}]}], "tools": [tool | {"function": {
        "name": "f", "description": "d"}}]}, LIMITS)  # fmt: skip


def test_a_body_that_trickles_in_is_refused_at_its_deadline():
    """The headers came, then some of the body, then nothing: a 408 at the deadline, not a connection
    held for as long as the client likes. A body that comes whole is read."""
    from starlette.requests import Request

    from ferry.entrypoints.openai.protocol import read_body

    def request(pieces: list[bytes], then_wait: bool) -> Request:
        async def receive():
            if pieces:
                return {"type": "http.request", "body": pieces.pop(0), "more_body": bool(pieces) or then_wait}
            await asyncio.Event().wait()  # a client that never sends the rest

        return Request({"type": "http", "method": "POST", "headers": [(b"content-length", b"100")]}, receive)

    with pytest.raises(OpenAIError) as e:
        asyncio.run(read_body(request([b'{"model": "m", ', b'"prom'], then_wait=True), timeout=0.2))
    assert e.value.status == 408 and "0.2 s" in e.value.message
    assert asyncio.run(read_body(request([b'{"a": ', b"1}"], then_wait=False), timeout=0.2)) == b'{"a": 1}'
