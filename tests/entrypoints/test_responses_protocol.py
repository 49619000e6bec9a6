"""A Responses API body as the chat it runs as (entrypoints/openai/responses_protocol.py): items to
messages, flat tools to chat tools, text.format to response_format, and its size bounded before
the schema walks it."""

from __future__ import annotations

import pytest

from ferry.entrypoints.openai.protocol import OpenAIError, PromptLimits, validate_body
from ferry.entrypoints.openai.responses_protocol import ResponsesRequest, precheck_responses


def chat_of(body: dict) -> dict:
    return validate_body(body, ResponsesRequest).to_chat().model_dump(exclude_defaults=True, by_alias=True)


def test_items_become_the_chat_an_agent_loop_had():
    chat = chat_of({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "w", "arguments": "{}", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{\"tz\": \"CET\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ]})  # fmt: skip
    calls = [{"id": "c1", "function": {"name": "w", "arguments": "{}"}},  # (type "function": a default)
             {"id": "c2", "function": {"name": "t", "arguments": '{"tz": "CET"}'}}]  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather ?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look.", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "noon", "tool_call_id": "c2"},
    ]


def test_tools_formats_and_limits_map_to_their_chat_fields():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat = chat_of({"input": "hi", "max_output_tokens": 7, "tools": [{"type": "function", "name": "f",
                    "parameters": schema, "strict": True}], "tool_choice": {"type": "function", "name": "f"},
                    "text": {"format": {"type": "json_schema", "name": "out", "schema": schema}},
                    "include": ["message.output_text.logprobs"], "top_logprobs": 3, "stream": True})  # fmt: skip
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["max_completion_tokens"] == 7 and chat["stream"] and chat["stream_options"]["include_usage"]
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    assert chat["logprobs"] and chat["top_logprobs"] == 3
    assert chat_of({"input": "hi", "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"}  # fmt: skip


def test_size_is_bounded_before_validation():
    limits = PromptLimits(max_tokens=99, max_chars=1000)
    precheck_responses({"input": "x" * 900, "instructions": "y" * 50}, limits)
    with pytest.raises(OpenAIError, match="input has 1050 characters"):
        precheck_responses({"input": "x" * 1000, "instructions": "y" * 50}, limits)
    with pytest.raises(OpenAIError, match="characters"):  # tools render too
        precheck_responses({"input": "x", "tools": [{"type": "function", "name": "f", "description": "d" * 2000}]},
                           limits)  # fmt: skip
    with pytest.raises(OpenAIError, match="at most 16384 input items"):
        precheck_responses({"input": [{}] * 16385}, limits)
