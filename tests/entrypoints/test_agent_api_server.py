"""The API agents and apps call, through `ferry serve` with the official openai client: `required`
and named tool choices return calls whose arguments follow the tools' schemas at temperature 0.8;
`auto` reads hermes `<tool_call>`s out of the text, streamed as `delta.tool_calls`; tool messages
render; an agent library (openai-agents) runs a tool loop; a reasoning parser splits
`reasoning_content` off and a grammar waits for the end of the reasoning; unimplemented fields
are a 400 naming them; /tokenize counts as chat renders; embeddings are the same alone or batched."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Annotated

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from pydantic import Field
from server_utils import ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 2, "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False},
    },
}  # fmt: skip
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                       "required": ["tz"], "additionalProperties": False},
    },
}  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Berlin?"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "1024", "--max-num-seqs", "16", "--served-model-name", "smol",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes")  # fmt: skip
    yield s
    assert s.stop() == 0, s.logs()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_choice_returns_valid_calls(client):
    r = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       n=3, temperature=0.8, max_tokens=200)  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)
    single = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice="required", parallel_tool_calls=False, n=3,
                                            temperature=0.8, max_tokens=200)  # fmt: skip
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)


def test_a_named_tool_choice_calls_that_tool_streamed_too(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                       temperature=0.8, max_tokens=100)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "stop"  # forced: OpenAI's "stop"
    check_call(call)
    stream = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                            temperature=0.8, max_tokens=100, stream=True)  # fmt: skip
    parts, names, finish = [], set(), None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                names.add(tc.function.name) if tc.function.name else None
                parts.append(tc.function.arguments or "")
            finish = c.finish_reason or finish
    assert names == {"get_time"} and len(parts) > 1 and finish == "stop"  # the arguments stream
    jsonschema.validate(json.loads("".join(parts)), SCHEMAS["get_time"])


# What a hermes-format model writes; the regex makes SmolLM2 write it (it was not trained to).
HERMES = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
          r'"unit": "celsius"\}\}\n</tool_call>')  # fmt: skip


def test_auto_reads_hermes_calls_out_of_the_text_whole_and_streamed(client):
    extra = {"structured_outputs": {"regex": HERMES}}
    r = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                                       temperature=0.8, extra_body=extra)  # fmt: skip
    msg = r.choices[0].message
    assert msg.content.strip() == "Checking." and r.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    check_call(call)
    stream = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                                            temperature=0.8, extra_body=extra, stream=True)  # fmt: skip
    content, calls = "", []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            assert "<tool_call>" not in (c.delta.content or "")
    assert content.strip() == "Checking."
    (call,) = calls
    assert call.index == 0 and call.function.name == "get_weather"
    check_call(call)
    # Without the regex the model answers in text, which stays content.
    plain = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], max_tokens=8,
                                           temperature=0.0)  # fmt: skip
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_a_tool_conversation_renders_and_bad_tool_messages_are_400(client, server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}  # fmt: skip
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]  # fmt: skip
    r = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0.0)  # fmt: skip
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    bad = [
        ({"messages": [*ASK, {"role": "tool", "content": "18 C"}]}, "messages.1.tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [call]}]}, "messages.0.tool_calls"),
        ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
        ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"messages": ASK, "tools": [WEATHER, WEATHER]}, "tools"),
        ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "get weather"}}]},
         "tools.0.function.name"),
        ({"messages": ASK, "functions": [WEATHER["function"]]}, "functions"),
        ({"messages": ASK, "guided_json": {"type": "object"}}, "guided_json"),
        ({"messages": ASK, "audio": {"voice": "alloy"}}, "audio"),
        ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages.0.audio"),
    ]  # fmt: skip
    for body, param in bad:
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "smol", "max_tokens": 4, **body},
                       timeout=60)  # fmt: skip
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "best_of": 2, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "does not implement `best_of`" in r.json()["error"]["message"]
    # Nulls ask for nothing; labels and storage hints are accepted no-ops.
    ok = {"model": "smol", "messages": ASK, "max_tokens": 2, "functions": None, "user": "u1", "store": False,
          "metadata": {"k": "v"}, "stream_options": None, "service_tier": "auto"}  # fmt: skip
    assert httpx.post(server.url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200
    # Arguments nested deeper than Python's JSON parser goes (a RecursionError, not a ValueError, once a
    # 500) are text the template takes as it is, like any arguments that are not a JSON object.
    deep = {**call, "function": {"name": "get_weather", "arguments": "[" * 100_000}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [deep]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]  # fmt: skip
    r = httpx.post(server.url + "/tokenize", json={"model": "smol", "messages": messages}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > 0, r.text


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agent_library_runs_a_tool_loop(server, api):
    """openai-agents against ferry, over chat completions and over the Responses API (its default
    model's): the first turn must call the tool (required, grammar-enforced), the tool's result goes
    back (a tool message, a function_call_output item), and the model answers in text."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: Annotated[str, Field(min_length=2, max_length=20)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is 18 degrees and sunny in {city}."

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model_class = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        model=model_class(model="smol", openai_client=client),
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=48),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert len(calls) == 1 and 2 <= len(calls[0]) <= 20  # called once, then the choice reset to auto
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()


@pytest.fixture(scope="module")
def thinker():
    s = ServerProcess("--max-model-len", "512", "--max-num-seqs", "4", "--served-model-name", "smol",
                      "--reasoning-parser", "deepseek_r1")  # fmt: skip
    yield s
    assert s.stop() == 0, s.logs()


def test_reasoning_is_split_off_and_a_grammar_waits_for_its_end(thinker):
    c = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(prefix: str, **kw):
        messages = [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": prefix}]
        extra = {"continue_final_message": True, "add_generation_prompt": False, **kw.pop("extra_body", {})}
        return c.chat.completions.create(model="smol", messages=messages, temperature=0.0, extra_body=extra, **kw)

    # The prompt opened <think>: the output continues the reasoning (cut off before </think>).
    free = ask("<think>", max_tokens=16).choices[0].message
    assert free.content is None and free.model_extra["reasoning_content"]
    # A grammar waits for </think>: the reasoning is the same free text as without one.
    gated = ask("<think>", max_tokens=16, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert gated.choices[0].message.model_extra["reasoning_content"] == free.model_extra["reasoning_content"]
    # Reasoning closed in the prompt: the grammar applies at once, and the answer is content.
    done = ask("<think>Clearly.</think>", max_tokens=16, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert done.choices[0].message.content in ("yes", "no")
    assert done.choices[0].message.model_extra["reasoning_content"] is None
    # Streamed: reasoning arrives in delta.reasoning_content.
    parts = [ch.choices[0].delta.model_extra.get("reasoning_content") or ""
             for ch in ask("<think>", max_tokens=16, stream=True) if ch.choices]  # fmt: skip
    assert "".join(parts) == free.model_extra["reasoning_content"]


def test_tokenize_detokenize_and_version(server, client):
    url = server.url
    r = httpx.post(url + "/tokenize", json={"model": "smol", "prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) > 1 and body["max_model_len"] == 1024
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "Hello world"
    back = httpx.post(url + "/detokenize", json={"model": "smol", "tokens": body["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    # A chat counts as /v1/chat/completions renders it, tools included.
    counted = httpx.post(url + "/tokenize", json={"model": "smol", "messages": ASK, "tools": [WEATHER]}).json()
    r = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert counted["count"] == r.usage.prompt_tokens
    for path, body, param in [
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [1] * 1025}, "tokens"),
        ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
        ("/tokenize", {"prompt": "x", "messages": ASK}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ]:
        r = httpx.post(url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert httpx.get(url + "/version").json()["version"]


def test_embeddings_alone_equal_batched_and_base64(server, client):
    texts = [f"Note {i}: {'the cat sleeps' if i % 2 else 'stocks fell'} at {i} o'clock." for i in range(32)]
    prompt_tokens = server.metric("ferry:prompt_tokens_total")
    batch = client.embeddings.create(model="smol", input=texts)
    assert [d.index for d in batch.data] == list(range(32)) and batch.usage.prompt_tokens > 32
    assert server.metric("ferry:prompt_tokens_total") - prompt_tokens == batch.usage.prompt_tokens  # prefilled

    async def alone():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(c.embeddings.create(model="smol", input=t) for t in texts[:8]))

    for one, b in zip(asyncio.run(alone()), batch.data[:8]):
        vec = np.asarray(one.data[0].embedding)
        assert vec.shape == (576,) and abs(np.linalg.norm(vec) - 1) < 1e-5
        np.testing.assert_allclose(vec, b.embedding, atol=1e-5)
    raw = httpx.post(server.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, batch.data[0].embedding, atol=1e-6)
    ids = httpx.post(server.url + "/tokenize", json={"prompt": texts[0]}).json()["tokens"]
    by_ids = httpx.post(server.url + "/v1/embeddings", json={"input": [ids]}).json()
    np.testing.assert_allclose(by_ids["data"][0]["embedding"], batch.data[0].embedding, atol=1e-5)
    # vLLM's truncate_prompt_tokens: the input's last k tokens embedded, as if sent alone.
    cut = httpx.post(server.url + "/v1/embeddings", json={"input": texts[0], "truncate_prompt_tokens": 5}).json()
    tail = httpx.post(server.url + "/v1/embeddings", json={"input": [ids[-5:]]}).json()
    assert cut["usage"]["prompt_tokens"] == 5 < len(ids)
    np.testing.assert_allclose(cut["data"][0]["embedding"], tail["data"][0]["embedding"], atol=1e-5)
    for body, param in [({"input": []}, "input"), ({"input": "x", "dimensions": 64}, "dimensions"),
                        ({"input": [1, 10**9]}, "prompt"), ({"input": "x", "encoding_format": "int8"},
                                                            "encoding_format"),
                        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]:  # fmt: skip
        r = httpx.post(server.url + "/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_score_and_rerank_are_cosine_similarities_of_the_embeddings(server, client):
    """vLLM's /score and /rerank over a decoder model: each pair's score is the cosine similarity of
    the texts' /v1/embeddings vectors; rerank orders the documents by it, best first."""
    query = "What is the capital of France?"
    docs = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.", "Horses and cows are animals."]
    embedded = client.embeddings.create(model="smol", input=[query, *docs]).data
    vectors = {t: np.asarray(d.embedding) for t, d in zip([query, *docs], embedded)}
    want = [float(vectors[query] @ vectors[d]) for d in docs]
    tokens = sum(len(httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"]) for t in [query, *docs])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(server.url + path, json={"model": "smol", "query": query, "documents": docs}).json()
        assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -want[i])
        for x in r["results"]:
            assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5 and x["document"]["text"] == docs[x["index"]]
        assert r["usage"]["total_tokens"] == tokens and r["model"] == "smol"
    top = httpx.post(server.url + "/v1/rerank", json={"query": query, "documents": docs, "top_n": 1,
                                                      "return_documents": False, "rank_fields": None,
                                                      "max_tokens_per_doc": 512}).json()["results"]  # fmt: skip
    assert len(top) == 1 and top[0]["index"] == max(range(3), key=lambda i: want[i]) and "document" not in top[0]
    one_to_many = httpx.post(server.url + "/score", json={"text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], want, atol=1e-5)
    pairwise = httpx.post(server.url + "/v1/score", json={"text_1": [query, docs[0]], "text_2": [docs[1], docs[2]]})
    np.testing.assert_allclose(
        [d["score"] for d in pairwise.json()["data"]],
        [vectors[query] @ vectors[docs[1]], vectors[docs[0]] @ vectors[docs[2]]],
        atol=1e-5,
    )
    for path, body, param in (("/score", {"text_1": [query] * 2, "text_2": docs}, "text_1"),
                              ("/score", {"text_1": query, "text_2": []}, "text_2"),
                              ("/rerank", {"query": "", "documents": docs}, "query"),
                              ("/rerank", {"query": query, "documents": []}, "documents"),
                              ("/rerank", {"query": query, "documents": docs, "top_n": -1}, "top_n"),
                              ("/rerank", {"query": query, "documents": docs, "model": "other"}, "model"),
                              ("/score", {"text_1": "a", "text_2": ["b"] * 1025}, "text_2"),
                              ("/rerank", {"query": query, "documents": [f"d{i}" for i in range(1024)]},
                               "documents")):  # fmt: skip
        r = httpx.post(server.url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"].startswith(param), r.text


def test_prompt_logprobs_and_echo_with_logprobs(server, client):
    prompt = "The capital of France is"
    n_prompt = len(httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"])
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=3, temperature=0.0,
                                  extra_body={"prompt_logprobs": 2})  # fmt: skip
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None and all(len(e) >= 2 for e in plp[1:])
    echo = client.completions.create(model="smol", prompt=prompt, max_tokens=3, temperature=0.0, echo=True,
                                     logprobs=2)  # fmt: skip
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(prompt) and len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, n_prompt):  # the echoed prompt's logprobs are the prompt_logprobs
        mine = [v["logprob"] for v in plp[pos].values() if v["decoded_token"] == lp.tokens[pos]]
        assert mine and abs(mine[0] - lp.token_logprobs[pos]) < 1e-5
    body = {"messages": ASK, "max_tokens": 1, "prompt_logprobs": 0}
    chat = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert len(chat.json()["prompt_logprobs"]) == chat.json()["usage"]["prompt_tokens"]
    streamed = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


# -- the Responses API (/v1/responses) -------------------------------------------------------------

FLAT = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]  # Responses' tools are flat


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def test_responses_answer_as_the_chat_does(client):
    """The same conversation, as Responses input and as chat messages: the same greedy text, and
    streamed the same text again in output_text deltas."""
    r = client.responses.create(model="smol", instructions="Answer briefly.", input="Say hi", max_output_tokens=8,
                                temperature=0)  # fmt: skip
    chat = client.chat.completions.create(model="smol", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hi"}])  # fmt: skip
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # 8 tokens cut it
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    assert r.usage.total_tokens == r.usage.input_tokens + 8 and r.id.startswith("resp")
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "incomplete"  # cut off, as the response

    events = events_of(client.responses.create(model="smol", instructions="Answer briefly.", input="Say hi",
                                               max_output_tokens=8, temperature=0, stream=True))  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text and len(deltas) > 1
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.output_text == r.output_text
    assert [o.status for o in last.response.output] == ["incomplete"]
    assert last.response.usage.output_tokens == 8
    kinds = [e.type for e in events if "delta" not in e.type]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]  # fmt: skip
    # The SDK's stream helper rebuilds the response from the events, checking each item's identity
    # from added to done (its get_final_response wants a completed one; this one is incomplete).
    with client.responses.stream(model="smol", instructions="Answer briefly.", input="Say hi", max_output_tokens=8,
                                 temperature=0) as stream:  # fmt: skip
        rebuilt = list(stream)[-1]
    assert rebuilt.type == "response.incomplete" and rebuilt.response.output_text == r.output_text


def test_responses_call_tools_and_take_their_outputs(client):
    r = client.responses.create(model="smol", input=ASK[0]["content"], tools=FLAT, tool_choice="required",
                                max_output_tokens=200, temperature=0.8)  # fmt: skip
    assert r.status == "completed" and r.output and all(o.type == "function_call" for o in r.output)
    assert all(o.status == "completed" for o in r.output)
    for call in r.output:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    named = client.responses.create(model="smol", input=ASK[0]["content"], tools=FLAT, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_time"}, stream=True)  # fmt: skip
    events = events_of(named)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = events[-1].response.output
    assert done.arguments == args == call.arguments and call.name == done.name == "get_time"
    with client.responses.stream(model="smol", input=ASK[0]["content"], tools=FLAT, max_output_tokens=60,
                                 tool_choice={"type": "function", "name": "get_time"}) as stream:  # fmt: skip
        (rebuilt,) = stream.get_final_response().output
    assert rebuilt.type == "function_call" and rebuilt.name == "get_time"
    jsonschema.validate(json.loads(rebuilt.arguments), SCHEMAS["get_time"])
    jsonschema.validate(json.loads(args), SCHEMAS["get_time"])
    # The call and its output go back as input items (as an agent loop sends them): the same text
    # as the chat with the assistant's tool call and the tool's message.
    args = '{"city": "Paris", "unit": "celsius"}'
    items = [{"role": "user", "content": ASK[0]["content"]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": args,
              "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C and sunny"}]  # fmt: skip
    r = client.responses.create(model="smol", input=items, tools=FLAT, tool_choice="none", max_output_tokens=8,
                                temperature=0)  # fmt: skip
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    messages = [*ASK, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]  # fmt: skip
    chat = client.chat.completions.create(model="smol", tools=[WEATHER, TIME], tool_choice="none", max_tokens=8,
                                          temperature=0, messages=messages)  # fmt: skip
    assert r.output_text == chat.choices[0].message.content and r.output_text


def test_responses_json_schema_logprobs_and_bad_requests(client, server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model="smol", input="Is the sky blue?", max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "yes_no", "schema": schema}},
                                include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)
    logprobs = r.output[0].content[0].logprobs
    assert "".join(lp.token for lp in logprobs) == r.output_text and len(logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    # Streamed, each text delta carries its own tokens' logprobs (OpenAI's events do), and together they
    # are the done event's and the unstreamed answer's (less a last token without text, an EOS).
    events = events_of(client.responses.create(model="smol", input="Is the sky blue?", max_output_tokens=30,
                       temperature=0, stream=True, include=["message.output_text.logprobs"], top_logprobs=2,
                       text={"format": {"type": "json_schema", "name": "yes_no", "schema": schema}}))  # fmt: skip
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and all(d.logprobs for d in deltas)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    streamed = [(lp.token, lp.logprob) for d in deltas for lp in d.logprobs]
    whole = [(lp.token, lp.logprob) for lp in done.logprobs]
    assert streamed == whole[: len(streamed)] and all(not t for t, _ in whole[len(streamed) :])
    assert [t for t, _ in whole] == [lp.token for lp in logprobs]
    assert all(abs(a - lp.logprob) < 1e-4 for (_, a), lp in zip(whole, logprobs))
    bad = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),  # nothing is stored
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),  # hosted tools are OpenAI's
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.message.content.0"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"text": {"format": {"type": "json_schema", "schema": schema}}}, "text.format.name"),
        ({"input": []}, "input"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),  # nothing is stored
        ({"stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ]  # fmt: skip
    for body, param in bad:
        r = httpx.post(server.url + "/v1/responses", json={"model": "smol", "input": "x", "max_output_tokens": 4,
                                                           **body}, timeout=60)  # fmt: skip
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    # Labels and storage hints (which the SDK and agent libraries send) are accepted no-ops.
    ok = {"model": "smol", "input": "x", "max_output_tokens": 2, "store": True, "metadata": {"k": "v"},
          "truncation": "disabled", "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"],
          "max_tool_calls": 4, "stream_options": {"include_obfuscation": False}}  # fmt: skip
    assert httpx.post(server.url + "/v1/responses", json=ok, timeout=60).status_code == 200
