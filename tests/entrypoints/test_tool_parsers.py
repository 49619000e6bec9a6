"""Tool-call and reasoning parsers on text: what they find in a finished output, and that streaming
the same output in any chunking yields the same content, reasoning and calls."""

from __future__ import annotations

import json
import random

import pytest

from ferry.entrypoints.openai.assistant_message import DeltaBuilder, message
from ferry.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError, validate_body
from ferry.entrypoints.openai.reasoning import ReasoningStream, reasoning_open_in_prompt, split_reasoning
from ferry.entrypoints.openai.tool_choice import RequiredCallsParser, tool_plan
from ferry.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedCall, ToolCallStream
from ferry.entrypoints.openai.tool_parsers.base import json_or_none, parsed_call

WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris"}))
TIME = ParsedCall("get_time", json.dumps({"tz": "CET", "24h": True}))


def chunkings(text: str, seed: int = 0):
    """The text whole, a character at a time, and in random pieces."""
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed(parser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    stream, content, calls = ToolCallStream(parser), [], []
    for i, piece in enumerate(pieces):
        c, new = stream.feed(piece, final=i == len(pieces) - 1)
        content.append(c)
        calls += new
    return "".join(content), calls


CASES = [
    # (parser, output, content, calls)
    ("hermes", "Let me check.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
     + "\n</tool_call>\n<tool_call>" + json.dumps({"name": "get_time", "arguments": {"tz": "CET", "24h": True}})
     + "</tool_call>", "Let me check.\n\n", [WEATHER, TIME]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("hermes", "<tool_call>{not json}</tool_call> done", "<tool_call>{not json}</tool_call> done", []),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [WEATHER]),  # unclosed
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', None,
     [WEATHER]),  # arguments as JSON text
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}) + "; "
     + json.dumps({"name": "get_time", "parameters": {"tz": "CET", "24h": True}}), None, [WEATHER, TIME]),
    ("llama3_json", "<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}), None,
     [WEATHER]),
    ("llama3_json", "The weather is {unknown} today.", "The weather is {unknown} today.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
    ("mistral", "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}},
                                             {"name": "get_time", "arguments": {"tz": "CET", "24h": True}}]),
     None, [WEATHER, TIME]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{"tz": "CET", "24h": true}',
     "Sure. ", [WEATHER, TIME]),
    ("mistral", "[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),
    # Calls, then text that is none: the calls stand (a stream sent them already), the rest is content.
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}) + " I called it.",
     "I called it.", [WEATHER]),
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}) + '; {"name": "get_ti',
     '{"name": "get_ti', [WEATHER]),  # the second cut off by max_tokens
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}) + ' {"answer": 42}',
     '{"answer": 42}', [WEATHER]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{"tz": "CET", "24h": true}'
     "[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", [WEATHER, TIME]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"} Done.', " Done.", [WEATHER]),
    ("mistral", "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}}]) + " ok",
     " ok", [WEATHER]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci', '[TOOL_CALLS][{"name": "get_weather", '
     '"arguments": {"ci', []),  # cut off in its list
]  # fmt: skip


@pytest.mark.parametrize("name,output,content,calls", CASES)
def test_parsers_find_calls_whole_and_streamed(name, output, content, calls):
    parser = TOOL_PARSERS[name]()
    assert parser.extract(output) == (content, calls)
    for pieces in chunkings(output):
        got_content, got_calls = streamed(parser, pieces)
        assert got_calls == calls, pieces
        assert got_content == (content or ""), pieces


def test_calls_nested_deeper_than_the_json_parser_goes_are_text():
    """A model can be steered (a regex grammar, a logit bias) into writing ~1000 brackets where a call
    goes: Python's parser raises RecursionError on them, which must read as "no call", not a 500."""
    deep = "[" * 5000
    outputs = {"hermes": f"<tool_call>{deep}</tool_call> <tool_call>{deep}", "llama3_json": deep,
               "mistral": "[TOOL_CALLS]" + deep}  # fmt: skip
    for name, output in outputs.items():
        parser = TOOL_PARSERS[name]()
        assert parser.extract(output) == (output, []), name
        for pieces in ([output], [output[:2500], output[2500:]]):
            assert streamed(parser, pieces) == (output, []), name
    assert parsed_call({"name": "f", "arguments": deep}) is None
    assert parsed_call({"name": "f", "arguments": json.loads("[" * 500 + "]" * 500)}) is None  # not an object
    assert json_or_none(deep) is None and json_or_none('{"a": 1}') == {"a": 1}


def test_streamed_content_goes_out_before_the_calls_and_holds_back_a_starting_tag():
    stream = ToolCallStream(TOOL_PARSERS["hermes"]())
    assert stream.feed("Checking <tool") == ("Checking ", [])  # "<tool" may open a call: held back
    assert stream.feed('_call>{"name": "get_weather", ') == ("", [])
    assert stream.feed('"arguments": {"city": "Paris"}}</tool_call>') == ("", [WEATHER])  # out as soon as closed
    assert stream.feed("", final=True) == ("", [])


def test_required_calls_parser_reads_the_grammar_list_and_the_calls_complete_in_a_cut_off_one():
    """max_tokens can cut the list: the calls complete before the cut stand, whole and streamed (a
    stream sent them already), and the cut-off one is neither a call nor content; cut in its
    first call, the text is content, as the stream sends it."""
    parser = RequiredCallsParser()
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}},
                       {"name": "get_time", "parameters": {"tz": "CET", "24h": True}}], indent=1)  # fmt: skip
    cut_second = text[: text.index("get_time") + 12]
    cut_first = text[: text.index("Paris")]
    for output, want in (
        (text, (None, [WEATHER, TIME])),
        (cut_second, (None, [WEATHER])),
        (cut_first, (cut_first, [])),
    ):
        assert parser.extract(output) == want
        for pieces in chunkings(output):
            assert streamed(parser, pieces) == (want[0] or "", want[1])


@pytest.mark.parametrize(
    "prompt_open,output,reasoning,content",
    [
        (False, "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.", "\nLet me see: 2+2.\n", "It is 4."),
        (True, "2+2 is 4, surely.</think>It is 4.", "2+2 is 4, surely.", "It is 4."),  # <think> in the prompt
        (True, "still thinking when max_tokens hit", "still thinking when max_tokens hit", None),
        (False, "A plain answer with a </think> in it.", None, "A plain answer with a </think> in it."),
        (False, "  <think>x</think>", "x", None),
    ],
)
def test_reasoning_split_whole_and_streamed(prompt_open, output, reasoning, content):
    assert split_reasoning(output, prompt_open) == (reasoning, content)
    for pieces in chunkings(output, seed=1):
        stream, r, c = ReasoningStream(prompt_open), [], []
        for i, piece in enumerate(pieces):
            dr, dc = stream.feed(piece, final=i == len(pieces) - 1)
            r.append(dr)
            c.append(dc)
        assert "".join(r) == (reasoning or ""), pieces
        assert "".join(c) == (content or ""), pieces


def test_reasoning_open_in_prompt():
    assert reasoning_open_in_prompt("<|assistant|><think>\n")
    assert not reasoning_open_in_prompt("<|assistant|><think>\n\n</think>\n\n")  # thinking switched off
    assert not reasoning_open_in_prompt("<|assistant|>")


def _body(**kw) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}} for n in ("get_weather", "get_time")]  # fmt: skip
    return validate_body({"messages": [{"role": "user", "content": "hi"}], "tools": tools, **kw},
                         ChatCompletionRequest)  # fmt: skip


def test_tool_plans_and_the_choices_a_server_refuses():
    assert tool_plan(_body(tool_choice="none"), None, False).grammar is None
    auto = tool_plan(_body(), "hermes", True)  # tools given, tool_choice unset: auto
    assert auto.mode == "auto" and auto.grammar is None
    required = tool_plan(_body(tool_choice="required", parallel_tool_calls=False), None, False)
    assert required.grammar.json["maxItems"] == 1
    assert {c["properties"]["name"]["enum"][0] for c in required.grammar.json["items"]["anyOf"]} == {
        "get_weather", "get_time"}  # fmt: skip
    named = tool_plan(_body(tool_choice={"type": "function", "function": {"name": "get_time"}}), None, False)
    assert named.function == "get_time" and named.grammar.json["type"] == "object"
    for kw, server, why in [
        ({}, (None, False), "--enable-auto-tool-choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, (None, False), "not among the tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, (None, False), "without"),
    ]:
        with pytest.raises(OpenAIError, match=why):
            tool_plan(_body(**kw), *server)
    with pytest.raises(OpenAIError, match="needs tools"):
        tool_plan(validate_body({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
                                ChatCompletionRequest), None, False)  # fmt: skip


def test_forced_calls_take_object_arguments_and_a_plain_text_format():
    """A tool's `parameters` of `{}` (no type) let a required or named call's grammar write `null`
    or a string as its arguments; a non-object schema is refused, as OpenAI does, and
    response_format "text" (the default, sent explicitly) does not clash with a forced call."""

    def body(parameters, **kw) -> ChatCompletionRequest:
        tool = {"type": "function", "function": {"name": "ping", "parameters": parameters}}
        return validate_body({"messages": [{"role": "user", "content": "hi"}], "tools": [tool], **kw},
                             ChatCompletionRequest)  # fmt: skip

    named = {"type": "function", "function": {"name": "ping"}}
    assert tool_plan(body({}, tool_choice=named), None, False).grammar.json == {"type": "object"}
    required = tool_plan(body({"properties": {"n": {"type": "integer"}}}, tool_choice="required"), None, False)
    assert required.grammar.json["items"]["anyOf"][0]["properties"]["parameters"] == {
        "properties": {"n": {"type": "integer"}}, "type": "object"}  # fmt: skip
    for choice in (named, "required"):
        with pytest.raises(OpenAIError, match='type "object", got type "string"'):
            tool_plan(body({"type": "string"}, tool_choice=choice), None, False)
        plan = tool_plan(body({}, tool_choice=choice, response_format={"type": "text"}), None, False)
        assert plan.grammar is not None


def test_named_call_message_and_streamed_arguments():
    """A forced call ends with finish_reason "stop", not "tool_calls" (OpenAI's and vLLM's)."""
    plan = tool_plan(_body(tool_choice={"type": "function", "function": {"name": "get_weather"}}), None, False)
    msg, called = message('{"city": "Paris"}', plan, None)
    assert not called and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    builder = DeltaBuilder(plan, None)
    first = builder.delta('{"city": ', final=False)["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    assert builder.delta('"Paris"}', final=True)["tool_calls"] == [{"index": 0, "function": {"arguments": '"Paris"}'}}]
    assert not builder.called
    auto = tool_plan(_body(), "hermes", True)
    assert message(CASES[0][1], auto, None)[1]  # a call the model chose: "tool_calls"


def test_auto_calls_without_parallel_keep_the_first():
    plan = tool_plan(_body(parallel_tool_calls=False), "hermes", True)
    text = CASES[0][1]
    msg, _ = message(text, plan, None)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    builder = DeltaBuilder(plan, None)
    deltas = [builder.delta(ch, final=i == len(text) - 1) for i, ch in enumerate(text)]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
