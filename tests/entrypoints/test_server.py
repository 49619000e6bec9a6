"""`ferry serve` as users run it: a real process on 127.0.0.1, driven with the official openai client."""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import tempfile
import threading
import time

import httpx
import openai
import pytest
from server_utils import ServerProcess, open_request, read_until, wait_for

from ferry.engine.core_client import remove_stale_ipc_dirs

LONG_PROMPT = "Here is a story about a lighthouse keeper who counted the ships passing by at night. " * 4


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "512", "--max-num-seqs", "8", "--served-model-name", "smol", "extra-name",
                      "--enable-kv-events", "--allow-client-priority", "--enable-log-requests",
                      "--enable-log-outputs", "--max-log-len", "12",
                      env={"FERRY_LOG_STATS_INTERVAL": "0.5"})  # fmt: skip
    yield s
    assert s.stop() == 0, s.logs()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def wait_idle(server: ServerProcess, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric("ferry:kv_cache_usage_perc") == 0 and server.metric("ferry:num_requests_running") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("KV cache not released: usage %s" % server.metric("ferry:kv_cache_usage_perc"))


def test_probes_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smol", "extra-name"]
    assert client.models.retrieve("extra-name").id == "extra-name"
    # Any of the names serves; answers name the first, as vLLM's do.
    assert client.completions.create(model="extra-name", prompt="Hi", max_tokens=1).model == "smol"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other-model")


def test_completion_stream_equals_non_stream(client):
    # ignore_eos: the length path whatever a kernel change does to where greedy decoding ends its answer
    kwargs = dict(model="smol", prompt="The capital of France is", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    full = client.completions.create(**kwargs)
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24 and full.usage.prompt_tokens == 5
    assert full.usage.total_tokens == 29
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and "Paris" in text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_equals_non_stream_and_multi_turn(client):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    full = client.chat.completions.create(model="smol", messages=messages, max_tokens=20, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage.prompt_tokens > 20
    stream = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # A different conversation gives a different prompt: the template really saw the turns.
    other = client.chat.completions.create(
        model="smol", messages=messages[:2], max_tokens=1, temperature=0
    ).usage.prompt_tokens  # fmt: skip
    assert other < full.usage.prompt_tokens


def test_prefix_cache_hits_are_reported_as_cached_tokens(server, client):
    first = client.completions.create(model="smol", prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    second = client.completions.create(model="smol", prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * ((n - 1) // 16) > 0
    assert server.metric("ferry:prefix_cache_hits_total") >= second.usage.prompt_tokens_details.cached_tokens


def test_kv_events_publish_the_prompt_blocks(server, client):
    """/ferry/info says where the events are; a subscriber sees the hashes the gateway would compute."""
    import msgspec
    import zmq

    from ferry.core.block_hash import hash_prompt_blocks
    from ferry.core.kv_events import KVEventBatch, ReplayRequest, ReplayResponse

    info = httpx.get(server.url + "/ferry/info", timeout=10).json()
    assert info["block_size"] == 16 and info["block_hash"] == "sha256-chained-v1" and info["models"][0] == "smol"
    ev = info["kv_events"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, ev["topic"].encode())
    sub.connect(f"tcp://{ev['host']}:{ev['port']}")
    try:
        time.sleep(0.3)  # let the subscription reach the publisher (PUB drops until then)
        ids = [random.Random(7).randrange(100, 40000) for _ in range(40)]
        client.completions.create(model="smol", prompt=ids, max_tokens=1, temperature=0)
        want = hash_prompt_blocks(ids, 16)
        seen: list[bytes] = []
        seqs: list[int] = []
        deadline = time.monotonic() + 10
        while not set(want) <= set(seen) and time.monotonic() < deadline:
            if sub.poll(200):
                batch = msgspec.msgpack.decode(sub.recv_multipart()[1], type=KVEventBatch)
                seqs.append(batch.seq)
                seen += [h for e in batch.events if hasattr(e, "block_hashes") for h in e.block_hashes]
        assert set(want) <= set(seen), (len(want), len(seen))
        assert seqs == sorted(seqs)
        # A snapshot from the replay socket holds them too.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://{ev['host']}:{ev['replay_port']}")
        dealer.send_multipart([b"", msgspec.msgpack.encode(ReplayRequest(0))])
        assert dealer.poll(5000), "no replay answer"
        snap = msgspec.msgpack.decode(dealer.recv_multipart()[-1], type=ReplayResponse).snapshot
        assert set(want) <= set(snap.block_hashes) and snap.seq >= seqs[-1]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()


def test_reset_prefix_cache(server, client):
    client.completions.create(model="smol", prompt=LONG_PROMPT + " reset", max_tokens=1, temperature=0)
    wait_idle(server)
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=10).json() == {"status": "ok"}
    again = client.completions.create(model="smol", prompt=LONG_PROMPT + " reset", max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_n_and_seed(client):
    kw = dict(model="smol", prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # children get seed + i
    assert a.usage.completion_tokens == 24
    c = client.completions.create(**{**kw, "seed": 99})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]
    chunks = list(client.completions.create(stream=True, **kw))
    by_index = {0: "", 1: ""}
    for ch in chunks:
        for choice in ch.choices:
            by_index[choice.index] += choice.text
    assert [by_index[0], by_index[1]] == [x.text for x in a.choices]
    # One choice a chunk, as OpenAI streams n > 1 (a client may read only choices[0] and its index).
    assert all(len(ch.choices) == 1 for ch in chunks)
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = list(client.chat.completions.create(model="smol", messages=messages, max_tokens=6, temperature=1.0, n=2,
                                               seed=7, stream=True))  # fmt: skip
    assert all(len(ch.choices) == 1 for ch in chat) and {ch.choices[0].index for ch in chat} == {0, 1}
    assert [ch.choices[0].delta.role for ch in chat[:2]] == ["assistant", "assistant"]


def test_stop_string(client):
    base = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=24, temperature=0)
    text = base.choices[0].text
    word = text.split()[2]  # a word from the middle of the greedy continuation
    out = client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=24, temperature=0, stop=[word]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(word)]
    assert out.choices[0].model_extra["stop_reason"] == word


def test_logprobs(client):
    out = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) >= 3
        assert max(top.values()) == pytest.approx(value)  # greedy: the sampled token is the top one
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Count: 1, 2, 3"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    # OpenAI's refusal: null, there (the SDK reads an absent field as None too: the fields set say it was sent)
    assert "refusal" in chat.choices[0].message.model_fields_set and chat.choices[0].message.refusal is None
    assert "refusal" in chat.choices[0].logprobs.model_fields_set and chat.choices[0].logprobs.refusal is None
    # A character split over tokens (the two byte-level tokens of U+1F642, forced): each token's own
    # bytes, which join back to the character, where its decoded text is U+FFFD.
    forced = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Say hi"}], max_tokens=2, temperature=0, logprobs=True,
        top_logprobs=1, logit_bias={"10813": 100, "38887": 100},
    )  # fmt: skip
    assert forced.choices[0].message.content == "\U0001f642"
    pieces = forced.choices[0].logprobs.content
    assert [p.bytes for p in pieces] == [[0xF0, 0x9F], [0x99, 0x82]]
    assert bytes(pieces[0].bytes + pieces[1].bytes).decode() == forced.choices[0].message.content


def test_echo_with_max_tokens_0_scores_the_prompt(client):
    """OpenAI's and vLLM's way to score a prompt: its tokens' logprobs, nothing generated."""
    prompt = "The capital of France is Paris."
    for stream in (False, True):
        options = {"include_usage": True} if stream else None
        r = client.completions.create(model="smol", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                      stream=stream, stream_options=options)  # fmt: skip
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert text == prompt and "".join(tokens) == prompt and finish == ["length"], (stream, chunks)
        assert usage.completion_tokens == 0 and usage.prompt_tokens == len(tokens)
        if stream:  # with include_usage every chunk has the field, null but in the last
            assert all(c.usage is None for c in chunks[:-1]) and "usage" in chunks[0].model_fields_set
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="smol", prompt=prompt, max_tokens=0)


def test_nulls_ask_for_the_default(server):
    """OpenAI's schema makes these nullable and SDKs send them so: null is the default, and
    best_of 1 (its default) asks for nothing; max_tokens null keeps vLLM's meaning (up to the context)."""
    ask = [{"role": "user", "content": "Hi"}]
    for path, body in (
        ("/v1/chat/completions", {"messages": ask, "n": None, "stream": None, "logprobs": None,
                                  "presence_penalty": None, "frequency_penalty": None, "parallel_tool_calls": None}),
        ("/v1/completions", {"prompt": "Hi", "n": None, "stream": None, "echo": None, "presence_penalty": None,
                             "best_of": 1}),
    ):  # fmt: skip
        r = httpx.post(server.url + path, json={"model": "smol", "max_tokens": 2, "temperature": 0, **body}, timeout=60)
        assert r.status_code == 200, (path, r.text)
        assert len(r.json()["choices"]) == 1


def test_continuous_usage_stats_put_each_choices_usage_so_far_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries its
    choice's prompt and generated tokens so far; the last, choice-less one the request's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for chat in (False, True):
        args = dict(model="smol", max_tokens=5, n=2, temperature=0.8, seed=1, stream=True, stream_options=options,
                    extra_body={"ignore_eos": True})  # fmt: skip
        if chat:
            chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **args))
        else:
            chunks = list(client.completions.create(prompt="Hello there", **args))
        final = chunks[-1]
        assert final.choices == [] and final.usage.completion_tokens == 10, final
        seen = {0: [], 1: []}
        for c in chunks[:-1]:
            assert c.usage is not None and c.usage.prompt_tokens == final.usage.prompt_tokens, c
            assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
            seen[c.choices[0].index].append(c.usage.completion_tokens)
        for counts in seen.values():  # growing to the choice's 5 tokens (chat: from 0, the role chunk)
            assert counts == sorted(counts) and counts[-1] == 5 and counts[0] == (0 if chat else 1), seen
    without = list(client.completions.create(model="smol", prompt="Hi", max_tokens=2, stream=True,
                                             stream_options={"continuous_usage_stats": True}))  # fmt: skip
    assert all(c.usage is None for c in without)  # continuous_usage_stats needs include_usage, as vLLM's


def test_prompt_forms_and_extras(client, server):
    tok_ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    outs = client.completions.create(
        model="smol", prompt=["The capital of France is", "Hello"], max_tokens=4, temperature=0
    )
    assert [c.index for c in outs.choices] == [0, 1]
    by_ids = client.completions.create(model="smol", prompt=tok_ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == outs.choices[0].text
    two = client.completions.create(model="smol", prompt=[tok_ids, tok_ids[:3]], max_tokens=4, temperature=0)
    assert two.choices[0].text == outs.choices[0].text and len(two.choices) == 2
    extra = client.completions.create(
        model="smol", prompt="Hello", max_tokens=6, temperature=0.8, user="u1",
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 6,
                    "priority": -1},
    )  # fmt: skip
    assert extra.usage.completion_tokens == 6


def test_allowed_token_ids_bad_words_and_prompt_truncation(server, client):
    """vLLM's extras: only the allowed tokens sampled; a bad word's tokens never completed; the
    prompt's last k tokens kept, so a prompt past the context runs instead of failing."""
    tok_ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    allowed = [28, 30, 216]
    r = client.completions.create(model="smol", prompt=tok_ids, max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True})  # fmt: skip
    assert r.usage.completion_tokens == 8 and set(r.choices[0].model_extra["token_ids"]) <= set(allowed)
    free = client.completions.create(model="smol", prompt=tok_ids, max_tokens=6, temperature=0)
    word = free.choices[0].text.split()[0].strip(".,")
    assert word.isalpha(), free.choices[0].text  # "Paris" for SmolLM2
    banned = client.completions.create(model="smol", prompt=tok_ids, max_tokens=6, temperature=0,
                                       extra_body={"bad_words": [word]})  # fmt: skip
    assert word not in banned.choices[0].text and banned.choices[0].text != free.choices[0].text
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Capital of France?"}],
                                          max_tokens=12, temperature=0, extra_body={"bad_words": [word]})  # fmt: skip
    assert word not in chat.choices[0].message.content
    long = LONG_PROMPT * 8
    ids = httpx.post(server.url + "/tokenize", json={"prompt": long}).json()["tokens"]
    assert len(ids) > 512
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol", prompt=long, max_tokens=4)
    cut = client.completions.create(model="smol", prompt=long, max_tokens=4, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 100})  # fmt: skip
    tail = client.completions.create(model="smol", prompt=ids[-100:], max_tokens=4, temperature=0, echo=True)
    assert cut.usage.prompt_tokens == 100 and cut.choices[0].text == tail.choices[0].text  # the kept part echoed
    most = client.completions.create(model="smol", prompt=long, max_tokens=1, temperature=0,
                                     extra_body={"truncate_prompt_tokens": -1})  # fmt: skip
    assert most.usage.prompt_tokens == 511 and most.usage.completion_tokens == 1
    wait_idle(server)


def test_use_beam_search_gives_the_offline_beams(server, client, smollm_gguf):
    """vLLM's use_beam_search: the n best beams, as LLM.beam_search finds them over the same model
    (the GGUF run as stored, as `ferry serve` runs it)."""
    from conftest import engine_over

    from ferry import LLM, BeamSearchParams

    prompts = ["The capital of France is", "Once upon a time"]
    r = client.completions.create(model="smol", prompt=prompts, n=3, max_tokens=5,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5})  # fmt: skip
    llm = LLM.from_engine(engine_over(smollm_gguf, max_model_len=512))
    offline = llm.beam_search(prompts, BeamSearchParams(3, 5, length_penalty=0.5))
    assert [c.index for c in r.choices] == list(range(6))
    tok, generated = llm.get_tokenizer(), 0
    for i, out in enumerate(offline):
        want = [
            tok.decode(s.tokens[len(s.tokens) - len(s.logprobs) :], skip_special_tokens=True) for s in out.sequences
        ]
        assert [c.text for c in r.choices[3 * i : 3 * i + 3]] == want
        generated += sum(len(s.logprobs) for s in out.sequences)
    assert r.usage.completion_tokens == generated
    # A chat: the rendered conversation's beams, as messages.
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model="smol", messages=messages, n=2, max_tokens=4,
                                          extra_body={"use_beam_search": True})  # fmt: skip
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    want = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(2, 4))[0].sequences
    assert [c.message.content for c in chat.choices] == [tok.decode(s.tokens[len(ids) :], skip_special_tokens=True)
                                                         for s in want]  # fmt: skip
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens == len(ids)
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "use_beam_search": True,
                                                                "logprobs": True})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs", bad.text
    for field, value in (("stream", True), ("logprobs", 0), ("stop", ["."]), ("bad_words", ["x"]), ("n", 11),
                         ("length_penalty", 400)):  # fmt: skip
        bad = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "use_beam_search": True, field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text  # (n: 2n > --max-logprobs)
    wait_idle(server)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"10": 500}}, 400, "logit_bias"),
        ({"prompt": [10**9]}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ({"prompt": "x", "stop_token_ids": [10**7]}, 400, "stop_token_ids"),
        ({"prompt": "x", "seed": 2**70}, 400, "seed"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": None, "min_tokens": 600}, 400, "min_tokens"),
        ({"prompt": "x", "min_tokens": 2**64}, 400, "min_tokens"),
        ({"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ({"prompt": "x", "logprobs": 21, "echo": True}, 400, "logprobs"),  # --max-logprobs: 20
        ({"prompt": "x", "best_of": 2}, 400, "best_of"),
        ({"prompt": ["x"] * 1025}, 400, "prompt"),
        ({"prompt": ["x"] * 20, "n": 100}, 400, "n"),  # 2,000 sequences > --max-queue-len 1024
        ({"prompt": "x", "allowed_token_ids": [10**7]}, 400, "allowed_token_ids"),
        ({"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
        ({"prompt": "x", "bad_words": ["no"] * 257}, 400, "bad_words"),
        ({"prompt": "x", "bad_words": [" "]}, 400, "bad_words"),
        ({"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ],
)
def test_errors_are_openai_shaped(server, body, status, param):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]


def test_a_chats_top_logprobs_past_max_logprobs_is_refused_under_its_own_name(server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 21,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    assert "max allowed: 20" in r.json()["error"]["message"]


def test_chat_template_cannot_be_replaced_by_the_client(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_oversized_body_is_413(server):
    r = httpx.post(server.url + "/v1/completions", content=b" " * (33 << 20), timeout=60)
    assert r.status_code == 413 and "error" in r.json()


def test_tiny_temperature_is_greedy(client):
    kw = dict(model="smol", prompt="The capital of France is", max_tokens=8)
    assert client.completions.create(temperature=1e-30, **kw).choices[0].text == (
        client.completions.create(temperature=0, **kw).choices[0].text
    )


def test_context_length_error_names_the_numbers(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="Hello there", max_tokens=600)
    msg = e.value.body["message"]
    assert "512" in msg and "600" in msg and "602" in msg
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', timeout=10)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_client_disconnect_aborts_and_frees_blocks(server):
    body = {"model": "smol", "prompt": LONG_PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    aborted_before = _success(server, "abort")
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens, then hang up
        assert any(line.startswith("data: ") for line in got)
        assert server.metric("ferry:kv_cache_usage_perc") > 0
    wait_idle(server)
    # Non-streaming: the client times out while the request runs.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    wait_idle(server)
    assert _success(server, "abort") >= aborted_before + 2


def _success(server: ServerProcess, reason: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith("ferry:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_names(server, client):
    client.completions.create(model="smol", prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in [
        "ferry:num_requests_running", "ferry:num_requests_waiting", "ferry:kv_cache_usage_perc",
        "ferry:prefix_cache_queries_total", "ferry:prefix_cache_hits_total", "ferry:prompt_tokens_total",
        "ferry:generation_tokens_total", "ferry:request_success_total", "ferry:num_preemptions_total",
        "ferry:time_to_first_token_seconds_bucket", "ferry:inter_token_latency_seconds_bucket",
        "ferry:e2e_request_latency_seconds_bucket", "ferry:request_queue_time_seconds_bucket",
        'ferry:cache_config_info{block_size="16"',
    ]:  # fmt: skip
        assert name in text, name
    assert server.metric("ferry:generation_tokens_total") >= 3
    assert server.metric("ferry:time_to_first_token_seconds_count") >= 1


def test_the_engine_logs_its_throughput_while_tokens_flow(server, client):
    """vLLM's periodic line (stats_log.py), every FERRY_LOG_STATS_INTERVAL seconds here: tokens
    counted while they flow, then one line that says they stopped (later idle lines are DEBUG)."""

    def lines() -> list[str]:
        with open(server.log.name, errors="replace") as f:
            return [line for line in f if "Avg prompt throughput" in line]

    before = len(lines())
    client.completions.create(model="smol", prompt="Count: one, two,", max_tokens=16, temperature=0)

    def counted() -> int | None:
        return next((i for i, line in enumerate(lines()[before:]) if "generation throughput: 0.0 " not in line), None)

    wait_for(lambda: counted() is not None, "a line that counted the tokens", timeout=60)
    wait_for(lambda: any("generation throughput: 0.0 tokens/s" in line for line in lines()[before + counted():]),
             "the line that says they stopped", timeout=60)  # fmt: skip
    assert "Engine 000: " in lines()[-1] and "KV cache usage: " in lines()[-1]


def test_requests_and_outputs_are_logged_as_vllm_logs_them(server):
    """--enable-log-requests logs a request's prompt and parameters as it is added (not the
    tenant's cache_salt), --enable-log-outputs each choice's whole text once it finishes, streamed
    or not, n > 1 once per choice, all cut to --max-log-len (12) characters or ids."""
    prompt = "The log of the ferry lists every crossing: the date, the weather and the tide."
    body = {"model": "smol", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "cache_salt": "tenant-secret-9"}  # fmt: skip
    with httpx.Client(timeout=60) as http:
        whole = http.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "logged-1"}).json()
        with http.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                         headers={"X-Request-Id": "logged-2"}) as r:  # fmt: skip
            streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                               if line.startswith("data: {") and json.loads(line[6:])["choices"])  # fmt: skip
        pair = http.post(server.url + "/v1/completions", json={**body, "n": 2, "seed": 3, "temperature": 1.0},
                         headers={"X-Request-Id": "logged-3"}).json()  # fmt: skip
    text = whole["choices"][0]["text"]
    assert streamed == text and len(text) > 12

    def lines(kind: str, rid: str) -> list[str]:
        with open(server.log.name, errors="replace") as f:
            return [line for line in f if f"{kind} cmpl-{rid}-" in line]

    wait_for(lambda: lines("Generated response", "logged-2"), "the streamed request's output line", timeout=30)
    for rid in ("logged-1", "logged-2"):
        (received,) = lines("Received request", rid)
        assert f"prompt: {prompt[:12]!r}, params: " in received and "max_tokens=16" in received
        assert "tenant-secret-9" not in received and "num_prompt_tokens: " in received
        (generated,) = lines("Generated response", rid)
        assert f"(choice 0): output: {text[:12]!r}, output_token_ids: [" in generated
        ids = generated.split("output_token_ids: [")[1].split("]")[0].split(", ")
        assert len(ids) == 12 and "finish_reason: length" in generated  # 16 generated, 12 shown
    choices = sorted(pair["choices"], key=lambda c: c["index"])
    generated = sorted(lines("Generated response", "logged-3"))
    assert len(generated) == 2 and len(lines("Received request", "logged-3")) == 1
    for c, line in zip(choices, generated):
        assert f"(choice {c['index']}): output: {c['text'][:12]!r}" in line


def test_x_request_id_names_the_answer(server):
    """vLLM's tracing: an X-Request-Id header names the answer (`cmpl-<id>`, `chatcmpl-<id>`,
    streamed chunks too); the engine's own ids stay unique, so two requests may send one id; a
    header that is not visible ASCII (a forged log line) is not used."""
    body = {"model": "smol", "prompt": "Hi", "max_tokens": 2}
    with httpx.Client(timeout=60) as http:
        ids = [http.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "trace-1"}).json()["id"]
               for _ in range(2)]  # fmt: skip
        assert ids == ["cmpl-trace-1", "cmpl-trace-1"]
        chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
        with http.stream("POST", server.url + "/v1/chat/completions", json=chat,
                         headers={"X-Request-Id": "trace-2"}) as r:  # fmt: skip
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks and {c["id"] for c in chunks} == {"chatcmpl-trace-2"}
        spaced = http.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "a b"}).json()["id"]
        assert spaced.startswith("cmpl-") and " " not in spaced and len(spaced) == len("cmpl-") + 32  # a random id


def test_per_request_metrics_as_vllms(server, client):
    """vLLM's per-request histograms, observed once a sequence finishes: prompt tokens and the
    request's n and max_tokens once per request, generated tokens, phases and time per output
    token per sequence; every finished_reason series from the start."""
    names = ["ferry:request_prompt_tokens", "ferry:request_generation_tokens", "ferry:request_params_n",
             "ferry:request_params_max_tokens", "ferry:request_time_per_output_token_seconds",
             "ferry:request_prefill_time_seconds", "ferry:request_decode_time_seconds",
             "ferry:request_inference_time_seconds", "ferry:iteration_tokens_total",
             "ferry:request_max_num_generation_tokens"]  # fmt: skip
    text = httpx.get(server.url + "/metrics").text
    for reason in ("stop", "length", "abort"):
        assert f'ferry:request_success_total{{finished_reason="{reason}",model_name="smol"}}' in text, reason
    before = {f"{n}_{k}": server.metric(f"{n}_{k}") for n in names for k in ("count", "sum")}
    prompt_before = server.metric("ferry:prompt_tokens_total")
    r = client.completions.create(model="smol", prompt="Count with me: one, two,", max_tokens=5, n=2, temperature=0.7,
                                  seed=1, extra_body={"ignore_eos": True})  # fmt: skip
    prompt = r.usage.prompt_tokens
    after = {key: server.metric(key) for key in before}

    def grew(name: str, count: int, total: float | None = None) -> None:
        assert after[f"{name}_count"] - before[f"{name}_count"] == count, name
        if total is not None:
            assert after[f"{name}_sum"] - before[f"{name}_sum"] == pytest.approx(total), name

    grew("ferry:request_prompt_tokens", 1, prompt)
    grew("ferry:request_params_n", 1, 2)
    grew("ferry:request_params_max_tokens", 1, 5)
    grew("ferry:request_generation_tokens", 2, 10)
    grew("ferry:request_max_num_generation_tokens", 1, 5)  # per request: its longest sequence
    for phase in names[4:8]:
        grew(phase, 2)
    # vLLM's tokens per engine step: the prompt's (each sequence's, less prefix hits) and 4 decode steps of 2
    steps = after["ferry:iteration_tokens_total_count"] - before["ferry:iteration_tokens_total_count"]
    computed = after["ferry:iteration_tokens_total_sum"] - before["ferry:iteration_tokens_total_sum"]
    assert steps >= 5 and prompt + 8 <= computed <= 2 * prompt + 8, (steps, computed, prompt)
    assert server.metric("ferry:prompt_tokens_total") - prompt_before == prompt  # once, not per sequence


def _mutations(rng: random.Random):
    junk = [None, True, -1, 0, 1.5, 10**30, -(10**30), "", "x" * 50, [], {}, [1, "a"], {"a": 1}, [[1, 2], 3],
            float("inf"), [[]], [-5], [1.0, 2.0], "NaN"]  # fmt: skip
    fields = ["prompt", "model", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "logprobs",
              "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p", "repetition_penalty",
              "min_tokens", "priority", "stop_token_ids", "stream_options", "echo", "ignore_eos", "messages",
              "top_logprobs", "max_completion_tokens", "user", "allowed_token_ids", "bad_words",
              "truncate_prompt_tokens"]  # fmt: skip
    for _ in range(160):
        base = (
            {"prompt": "Hi", "max_tokens": 2}
            if rng.random() < 0.5
            else {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        )
        for _ in range(rng.randint(1, 3)):
            base[rng.choice(fields)] = rng.choice(junk)
        raw = json.dumps(base, allow_nan=True).encode()
        if rng.random() < 0.15:
            cut = rng.randint(0, len(raw))
            raw = raw[:cut] + bytes([rng.randint(0, 255)]) + raw[cut + 1 :]
        yield rng.choice(["/v1/completions", "/v1/chat/completions"]), raw
    yield "/v1/completions", b"[" * 100_000
    yield "/v1/completions", b"\xff\xfe"
    yield "/v1/completions", b'"just a string"'
    yield "/v1/chat/completions", b'{"messages": [{"role": "tool", "content": "x"}]}'
    yield "/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'


def test_fuzz_malformed_bodies_never_5xx(server):
    rng = random.Random(0)
    with httpx.Client(timeout=60) as http:
        for path, raw in _mutations(rng):
            r = http.post(server.url + path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code < 500, (raw[:300], r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert "error" in r.json()
            elif b'"stream": true' in raw:
                assert r.text.rstrip().endswith("data: [DONE]")
    assert httpx.get(server.url + "/health").status_code == 200
    wait_idle(server)


# -- lifecycle: queue limit, drain on SIGTERM, EngineCore death ----------------------------------------------------


def test_queue_limit_then_sigterm_drain():
    # One request runs and takes the only slot: 8,000 tokens, ~40 s at this machine's ~5 ms a token,
    # where the checks before SIGTERM take a few seconds (it is let go once the drain is seen). The
    # drain timeout only bounds a failure: on a busy machine the queued request's tokens can take
    # minutes, and the drain must wait for them (as it would for a user).
    s = ServerProcess("--max-model-len", "8192", "--max-num-seqs", "1", "--max-queue-len", "1",
                      "--drain-timeout", "900")  # fmt: skip
    running = None
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        results: dict[str, object] = {}

        def stream(name: str, max_tokens: int) -> None:
            try:
                chunks = list(client.completions.create(
                    model=None, prompt="Tell me a story.", max_tokens=max_tokens, stream=True,
                    extra_body={"ignore_eos": True}, temperature=0,
                ))  # fmt: skip
                results[name] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            except Exception as e:  # noqa: BLE001 - recorded for the assertion below
                results[name] = e

        running = open_request(s.url, "/v1/completions", {"prompt": "Tell me a story.", "max_tokens": 8000,
                               "ignore_eos": True, "stream": True, "temperature": 0})  # fmt: skip
        read_until(running, b"data: {")
        _wait_metric(s, "ferry:num_requests_running", 1)

        # A client that gives up while its request is still queued (nothing streamed yet) aborts it.
        aborted_before = _success(s, "abort")
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5,
                              "stream": True}, timeout=httpx.Timeout(30, read=1.0)) as r:  # fmt: skip
                for _ in r.iter_lines():
                    pass
        deadline = time.monotonic() + 60
        while _success(s, "abort") < aborted_before + 1 or s.metric("ferry:num_requests_waiting") > 0:
            assert time.monotonic() < deadline, "the queued request was not aborted on disconnect"
            time.sleep(0.05)
        assert s.metric("ferry:num_requests_running") == 1  # the long request is still going
        queued = threading.Thread(target=stream, args=("queued", 5))
        queued.start()
        _wait_metric(s, "ferry:num_requests_waiting", 1)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(prompt="x", max_tokens=2, model=None)
        assert e.value.response.headers["retry-after"] == "1"

        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while httpx.get(s.url + "/ready").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        # Draining: the running request goes on decoding and the queued one waits for the slot.
        generated = s.metric("ferry:generation_tokens_total")
        _wait_metric(s, "ferry:generation_tokens_total", generated + 8)
        assert s.metric("ferry:num_requests_waiting") == 1 and "queued" not in results
        # Its client leaves (8,000 tokens would take a minute here): the drain serves the queued request
        # in its place, to the end, then the server exits cleanly.
        running.close()
        queued.join(900)
        assert results == {"queued": "length"}
        assert s.proc.wait(120) == 0, s.logs()
    finally:
        if running is not None:
            running.close()
        s.stop()


def _wait_metric(s: ServerProcess, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while s.metric(name) < value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


def test_engine_core_death_makes_server_unready_and_exit_nonzero():
    s = ServerProcess("--max-model-len", "256")
    try:
        import os

        lines: list[str] = []
        body = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        _wait_metric(s, "ferry:generation_tokens_total", 3)
        os.kill(s.core_pid(), signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive(), "the in-flight stream hung after the core died"
        assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"  # told in-band, then closed
        assert s.proc.wait(30) != 0
        assert "EngineCore" in s.logs()
    finally:
        s.stop()


def test_vllm_serving_flags(tmp_path):
    """vLLM's --response-role, --enable-force-include-usage, --return-tokens-as-token-ids,
    --scheduling-policy and --disable-uvicorn-access-log do what they do there; --disable-fastapi-docs and
    --enable-prompt-tokens-details are accepted (ferry serves no docs and reports cached tokens anyway)."""
    s = ServerProcess("--max-model-len", "256", "--response-role", "bot", "--enable-force-include-usage",
                      "--uvicorn-log-level", "info", "--disable-uvicorn-access-log", "--disable-fastapi-docs",
                      "--enable-prompt-tokens-details", "--return-tokens-as-token-ids",
                      "--scheduling-policy", "priority")  # fmt: skip
    try:
        ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
        r = httpx.post(s.url + "/v1/chat/completions", json={**ask, "priority": 3}, timeout=60).json()
        assert r["choices"][0]["message"]["role"] == "bot"  # (and a priority taken: --scheduling-policy priority)
        assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        # Continuing the assistant's message: the answer is that message's role, as in vLLM.
        cont = {**ask, "messages": [*ask["messages"], {"role": "assistant", "content": "Hello"}],
                "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
        r = httpx.post(s.url + "/v1/chat/completions", json=cont, timeout=60).json()
        assert r["choices"][0]["message"]["role"] == "assistant"
        # Streams that did not ask for usage end with it all the same.
        for path, body in (("/v1/chat/completions", ask), ("/v1/completions", {"prompt": "Hi", "max_tokens": 3})):
            with httpx.stream("POST", s.url + path, json={**body, "stream": True}, timeout=60) as stream:
                events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3, events[-1]
            if path == "/v1/chat/completions":
                assert events[0]["choices"][0]["delta"]["role"] == "bot"
        # A client's continuous_usage_stats (without include_usage) is kept: usage on every chunk.
        cont_body = {**ask, "stream": True, "stream_options": {"continuous_usage_stats": True}}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=cont_body, timeout=60) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
        assert all(e["usage"] is not None for e in events) and events[-1]["choices"] == []
        # Logprobs name tokens by id (a request's own false wins); chat's bytes stay the tokens' own.
        body = {"prompt": "The sky is", "max_tokens": 4, "logprobs": 2, "return_token_ids": True, "temperature": 0}
        choice = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
        plain = httpx.post(s.url + "/v1/completions", json={**body, "return_tokens_as_token_ids": False},
                           timeout=60).json()["choices"][0]  # fmt: skip
        assert "".join(plain["logprobs"]["tokens"]) == plain["text"] == choice["text"]
        r = httpx.post(s.url + "/v1/chat/completions", json={**ask, "logprobs": True, "top_logprobs": 1},
                       timeout=60).json()["choices"][0]  # fmt: skip
        content = r["logprobs"]["content"]
        assert all(e["token"].startswith("token_id:") for e in content)
        assert bytes(b for e in content for b in e["bytes"]).decode() == r["message"]["content"]
        logs = s.logs()
        assert "Uvicorn running" in logs or "Application startup complete" in logs  # uvicorn logs at info ...
        assert "POST /v1/chat/completions HTTP/1.1" not in logs  # ... but no access lines (it did without the flag)
    finally:
        s.stop()


def test_bench_serve_load_generator(server):
    """`ferry bench serve`'s client against the real server: exact token counts, sane latencies."""
    import math

    from ferry.bench.serve import bench_once, parse_slos

    requests = [([100 + i, 200, 300, 400], n) for i, n in enumerate((3, 5, 8))]
    run = bench_once(server.url, None, requests, math.inf, 2, 60, 0, parse_slos(["ttft:60000", "tpot:60000"]))
    assert run["completed"] == 3 and run["failed"] == 0 and run["model"] == "smol"
    assert run["output_tokens"] == 16 and run["prompt_tokens"] == 12
    assert 0 < run["ttft"]["p50"] <= run["e2e"]["p50"]
    assert run["tpot"]["mean"] > 0 and run["goodput"] == pytest.approx(run["request_throughput"])
    strict = bench_once(server.url, None, requests[:1], math.inf, None, 60, 0, parse_slos(["ttft:0.001"]))
    assert strict["goodput"] == 0 and strict["completed"] == 1


def test_engine_core_exits_when_the_api_process_is_killed():
    s = ServerProcess("--max-model-len", "2048")
    core = s.core_pid()
    # ~2,000 decode steps (tens of seconds) of work left when the parent dies: the core must
    # not finish them first.
    body = {"prompt": "Tell me a story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())
        s.proc.kill()
    s.proc.wait(10)
    deadline = time.monotonic() + 5
    while _alive(core):
        assert time.monotonic() < deadline, "EngineCore outlived its API process"
        time.sleep(0.1)
    # Nothing ran at the SIGKILL, so its socket directory is left: the next client removes it.
    (left,) = glob.glob(os.path.join(tempfile.gettempdir(), f"ferry-ipc-{s.proc.pid}-*"))
    assert left in remove_stale_ipc_dirs() and not os.path.exists(left)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_engine_that_cannot_start_makes_serve_exit_1_with_the_reason():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "ferry.cli", "serve", "--port", "0", "--num-kv-blocks", "2", "--max-model-len", "4096"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "needs 256 KV blocks, but the KV cache has 2" in proc.stderr
    assert "never retrieved" not in proc.stderr and proc.stderr.count("EngineCore is gone") == 1


def test_startup_phases_are_reported(server):
    """/ferry/info's startup_seconds (what `ferry bench startup` reads): every phase, none negative, the
    core's phases within its own total, and the API process's start plus the core's within the whole."""
    s = httpx.get(server.url + "/ferry/info", timeout=10).json()["startup_seconds"]
    phases = {"api_process_start", "core_process_start", "load_weights", "kv_cache", "warm_up", "tokenizer"}
    assert phases | {"core_total", "total"} <= set(s)
    assert all(v >= 0 for v in s.values())
    assert s["core_process_start"] + s["load_weights"] + s["kv_cache"] + s["warm_up"] <= s["core_total"] + 0.05
    # (/proc's start time counts in 10 ms ticks: a little slack for the two clocks)
    assert s["api_process_start"] + s["core_total"] <= s["total"] + 0.1


def test_the_api_process_loads_no_torch(server):
    """The API process tokenizes, detokenizes and serves HTTP; torch is the engine core's alone (its
    import is ~1 s of the start, and memory). Checked on the running server: torch's library is mapped
    in the core's address space and not in the API process's, a request served since."""
    httpx.post(server.url + "/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 2}, timeout=60)

    def maps_torch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch_cpu" in f.read()

    assert maps_torch(server.core_pid())
    assert not maps_torch(server.proc.pid)
