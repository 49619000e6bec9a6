"""API keys, token rate limits, the result cache and usage parsing, on their own."""

import json

import msgspec
import pytest

from ferry.gateway.auth import ApiKeys, KeyLimits
from ferry.gateway.rate_limit import TokenRateLimiter
from ferry.gateway.response_usage import (
    StreamEnd,
    UsageChunkFilter,
    first_text_chunk,
    has_error_event,
    response_usage,
)
from ferry.gateway.result_cache import ResultCache, cache_key, is_deterministic


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_api_keys_from_lines_and_json(tmp_path):
    lines = tmp_path / "keys.txt"
    lines.write_text("# team keys\nsk-alpha\n\n  sk-beta  \n")
    keys = ApiKeys.from_file(str(lines))
    assert keys.authenticate("Bearer sk-alpha").name == "key-0"
    assert keys.authenticate("bearer sk-beta").name == "key-1"
    for bad in (None, "", "Bearer", "Bearer sk-gamma", "Basic sk-alpha", "sk-alpha", "Bearer sk-alph"):
        assert keys.authenticate(bad) is None, bad
    assert all(not hasattr(k, "key") for k in keys.keys)  # only digests are kept
    js = tmp_path / "keys.json"
    js.write_text(json.dumps([{"key": "sk-a", "name": "team-a", "total_tokens_per_minute": 100}, {"key": "sk-b"}]))
    keys = ApiKeys.from_file(str(js))
    a = keys.authenticate("Bearer sk-a")
    assert a.name == "team-a" and a.limits == KeyLimits(total_tokens_per_minute=100)
    assert keys.authenticate("Bearer sk-b").limits == KeyLimits()


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "no keys"),
        ('[{"name": "x"}]', "needs a non-empty string 'key'"),
        ('[{"key": "k", "total_tokens_per_minute": 0}]', "positive integer"),
        ('[{"key": "k", "tpm": 5}]', "unknown fields"),
        ('[{"key": "k"}, {"key": "k", "name": "other"}]', "twice"),
        ("[not json", "not valid JSON"),
    ],
)
def test_bad_key_files_are_clear_errors(tmp_path, content, match):
    f = tmp_path / "keys"
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        ApiKeys.from_file(str(f))


def test_rate_limit_admits_on_estimate_reconciles_and_says_when():
    clock = Clock()
    rl = TokenRateLimiter(clock)
    limits = KeyLimits(prompt_tokens_per_minute=100, total_tokens_per_minute=150)
    c1, _, _ = rl.admit("k", limits, 60, 50)
    assert c1 is not None
    clock.t += 10
    # 60 + 50 charged; another 50 + 40 breaks both the prompt (110) and total (200) limits.
    c2, wait, why = rl.admit("k", limits, 50, 40)
    assert c2 is None and wait == pytest.approx(50.0) and "per minute" in why
    # The first response used only 5 completion tokens: the estimate's rest is given back.
    rl.reconcile(c1, 60, 5)
    assert rl.usage("k") == (60, 5)
    c3, _, _ = rl.admit("k", limits, 30, 40)  # prompt 90 <= 100, total 135 <= 150
    assert c3 is not None
    clock.t += 51  # the first charge leaves the window
    assert rl.usage("k") == (30, 40)
    # A request larger than a limit can never pass: no wait helps (the gateway answers 400).
    c4, wait, why = rl.admit("k", limits, 101, 0)
    assert c4 is None and wait is None and "more than the key's 100" in why
    assert rl.usage("other") == (0, 0)  # limits are per key


def test_result_cache_only_deterministic_lru_bytes_and_ttl():
    assert is_deterministic({"temperature": 0})
    assert is_deterministic({"seed": 3, "temperature": 0.8})
    assert not is_deterministic({}) and not is_deterministic({"temperature": 0.7})
    assert cache_key("/v1/completions", {"a": 1, "b": 2}, "k") == cache_key("/v1/completions", {"b": 2, "a": 1}, "k")
    assert cache_key("/v1/completions", {"a": 1}, "k") != cache_key("/v1/chat/completions", {"a": 1}, "k")
    assert cache_key("/v1/completions", {"a": 1}, "k") != cache_key("/v1/completions", {"a": 1}, "other-key")
    # A body too deep to write out again (the gateway's stack is deeper than the decoder's was) is not
    # cached: no key, where a RecursionError was a 500.
    deep = []
    for _ in range(5000):
        deep = [deep]
    assert cache_key("/v1/completions", {"metadata": deep, "temperature": 0}, "k") is None
    assert cache_key("/v1/completions", {"metadata": msgspec.json.decode(b"[" * 50 + b"]" * 50)}, "k") is not None
    clock = Clock()
    cache = ResultCache(max_entries=2, max_bytes=10, ttl=5, clock=clock)
    assert cache.put("a", 200, {}, b"1234", "w0") and cache.put("b", 200, {}, b"5678", "w0")
    assert cache.get("a").body == b"1234"  # a is now the most recent
    cache.put("c", 200, {}, b"90", "w1")  # 3 entries > 2: b (least recent) goes
    assert cache.get("b") is None and cache.get("c").worker == "w1"
    assert not cache.put("big", 200, {}, b"x" * 11, "w0")  # larger than the whole cache
    cache.put("d", 200, {}, b"123456", "w0")  # 4 + 2 + 6 > 10 bytes: evict until it fits
    assert cache.bytes <= 10 and cache.get("d") is not None
    clock.t += 6
    assert cache.get("d") is None and len(cache) < 3  # expired


def test_response_usage_from_json_and_sse():
    body = json.dumps({"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 7, "completion_tokens": 2}})
    assert response_usage(body.encode(), streamed=False) == (7, 2, True)
    embedded = json.dumps({"data": [], "usage": {"prompt_tokens": 7, "total_tokens": 7}})  # no completion_tokens
    assert response_usage(embedded.encode(), streamed=False) == (7, 0, True)
    chunks = [
        b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n',
        b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n',
        b'data: {"choices": [{"delta": {"content": "lo"}}]}\n\n',
    ]
    assert not first_text_chunk(chunks[0]) and first_text_chunk(chunks[1])
    without = b"".join(chunks) + b"data: [DONE]\n\n"
    assert response_usage(without, streamed=True) == (None, 2, False)  # counted from the text chunks
    with_usage = (
        b"".join(chunks) + b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert response_usage(with_usage, streamed=True) == (9, 2, True)
    # vLLM's continuous_usage_stats: every chunk carries one choice's usage so far (n = 2 here); the
    # charge is the choice-less last chunk's, and a stream cut short before it is counted, not exact
    continuous = (b'data: {"choices": [{"index": 0, "text": "a"}], "usage": {"prompt_tokens": 9, '
                  b'"completion_tokens": 1}}\n\n'
                  b'data: {"choices": [{"index": 1, "text": "b"}], "usage": {"prompt_tokens": 9, '
                  b'"completion_tokens": 1}}\n\n'
                  b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}\n\n')  # fmt: skip
    assert response_usage(continuous, streamed=True) == (9, 2, True)
    cut_short = continuous.rsplit(b"data:", 1)[0] + b'data: {"error": {"message": "timed out"}}\n\n'
    assert response_usage(cut_short, streamed=True) == (None, 2, False)
    assert response_usage(b"not json", streamed=False) == (None, None, False)
    # n = 2: one chunk with text in both choices counts twice.
    two = b'data: {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}\n\n'
    assert response_usage(two, streamed=True) == (None, 2, False)
    assert has_error_event(b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n')
    assert not has_error_event(without)


def test_responses_api_usage_first_token_and_end():
    """/v1/responses: usage named input_tokens / output_tokens, a stream's in its last event (which
    may span chunks, and ends the stream); its text deltas mark the first token; response.failed is
    an error."""
    usage = {"input_tokens": 11, "output_tokens": 3, "total_tokens": 14}
    assert response_usage(json.dumps({"object": "response", "usage": usage}).encode(), streamed=False) == (11, 3, True)

    def event(kind: str, **fields) -> bytes:
        return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **fields}).encode() + b"\n\n"

    created = event("response.created", response={"id": "resp-1", "usage": None})
    delta = event("response.output_text.delta", item_id="msg_1", delta="Hi")
    final = event("response.completed", response={"id": "resp-1", "usage": usage, "output": ["x" * 100]})
    assert not first_text_chunk(created) and first_text_chunk(delta)
    assert response_usage(created + delta + final, streamed=True) == (11, 3, True)
    assert response_usage(created + delta, streamed=True) == (None, 1, False)  # cut short: counted
    end = StreamEnd()
    assert not end.feed(created) and not end.feed(delta)
    assert not end.feed(final[:40]) and not end.feed(final[40:-5]) and end.feed(final[-5:])
    # Cut inside the marker, and between the two newlines that end the event; CRLF lines.
    split = StreamEnd()
    assert not split.feed(created + final[:12]) and not split.feed(final[12:-1]) and split.feed(final[-1:])
    crlf = StreamEnd()
    assert not crlf.feed(created) and crlf.feed(final.replace(b"\n", b"\r\n"))
    assert StreamEnd().feed(b'data: {"choices": []}\n\ndata: [DO') is False
    assert StreamEnd().feed(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
    assert has_error_event(created + event("response.failed", response={"error": {"code": "server_error"}}))
    assert not has_error_event(created + delta + final)


def test_a_cache_hit_is_replayed_under_its_own_id():
    from ferry.gateway.result_cache import with_answer_id

    body = b'{"id":"cmpl-alice-1","choices":[{"text":"say \\"cmpl-alice-1\\""}]}'
    assert with_answer_id(body, False, "bob") == b'{"id":"cmpl-bob","choices":[{"text":"say \\"cmpl-alice-1\\""}]}'
    quoted = b'data: {"id": "chatcmpl-a\\"b", "n": 1}\n\ndata: {"id": "chatcmpl-a\\"b"}\n\ndata: [DONE]\n\n'
    fresh = with_answer_id(quoted, True, None)
    ids = {json.loads(line[6:])["id"] for line in fresh.decode().splitlines() if line.startswith("data: {")}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-") and b'a\\"b' not in fresh
    assert with_answer_id(b'{"object": "list"}', False, "x") == b'{"object": "list"}'
    # A Responses API stream: the id is inside each event's response.
    events = (b'event: response.created\ndata: {"type": "response.created", "response": {"id": "resp-alice"}}\n\n'
              b'event: response.completed\ndata: {"type": "response.completed", "response": {"id": "resp-alice"}}'
              b"\n\n")  # fmt: skip
    replayed = with_answer_id(events, True, "bob")
    assert replayed.count(b'"id": "resp-bob"') == 2 and b"alice" not in replayed


def test_a_forwarded_stream_asks_for_usage_and_for_no_more():
    """The gateway's added include_usage does not switch on the continuous usage a client asked
    for without include_usage (vLLM gives none then); a client's own include_usage goes as sent."""
    from ferry.entrypoints.openai.protocol import CompletionRequest
    from ferry.gateway.admission import forwarded_body

    data = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    out, strip = forwarded_body(data, CompletionRequest.model_validate(data), None, True)
    assert strip and out["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    asked = {**data, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    out, strip = forwarded_body(asked, CompletionRequest.model_validate(asked), None, True)
    assert not strip and out["stream_options"] == asked["stream_options"]


def test_a_stream_asked_for_usage_by_the_gateway_reaches_the_client_as_without():
    """The gateway adds include_usage to every stream (to settle charges): for a client that did not
    ask, the usage event goes and the other events' null usage too, in any cut of the bytes."""
    worker = (b'data: {"id":"c","choices":[{"index":0,"text":"Hi"}],"usage":null}\n\n'
              b'data: {"id":"c","choices":[{"index":0,"text":"!"}],"usage":null}\n\n'
              b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
              b"data: [DONE]\n\n")  # fmt: skip
    want = (b'data: {"id":"c","choices":[{"index":0,"text":"Hi"}]}\n\n'
            b'data: {"id":"c","choices":[{"index":0,"text":"!"}]}\n\n'
            b"data: [DONE]\n\n")  # fmt: skip
    for cut in (1, 7, 40, len(worker)):
        strip = UsageChunkFilter()
        got = b"".join(strip.feed(worker[i : i + cut]) for i in range(0, len(worker), cut)) + strip.flush()
        assert got == want, cut
