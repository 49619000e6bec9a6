"""`ferry serve` against a hostile client: bounded work per request, strict types, API keys, cache
salts, a stalled engine core and request deadlines. Real server processes on 127.0.0.1, real sockets."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from server_utils import ServerProcess

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
APP = "https://app.example"  # the one origin whose pages may call the server (--allowed-origins)
# --chat-template: a keyed server shows only its digest on the open /ferry/info.
TEMPLATE = (
    "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<<a>>{% endif %}"
)
STORY = "Here is a story about a lighthouse keeper who counted the ships passing by at night. " * 3


PREFIX = "/llm"  # --root-path: a proxy may forward it or strip it


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "512", "--max-num-seqs", "4", "--served-model-name", "smol",
                      "--api-key", KEY, "--engine-stall-timeout", "5", "--allowed-origins", json.dumps([APP]),
                      "--enable-request-id-headers", "--chat-template", TEMPLATE, "--root-path", PREFIX)  # fmt: skip
    yield s
    assert s.stop() == 0, s.logs()


def post(server: ServerProcess, body, path: str = "/v1/completions", **kw) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **AUTH, **kw.pop("headers", {})}
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=kw.pop("timeout", 60), **kw)


def wait_until(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def idle(server: ServerProcess) -> bool:
    return server.metric("ferry:kv_cache_usage_perc") == 0 and server.metric("ferry:num_requests_running") == 0


def test_api_key_guards_the_v1_routes_and_not_the_probes(server):
    """The key guards the same routes whether the --root-path prefix comes with the path or not."""
    body = {"prompt": "Hi", "max_tokens": 2}
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/embeddings", "/reset_prefix_cache",
                  "/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank", "/v1/load_lora_adapter"):  # fmt: skip
        path = route if route != "/v1/models" else PREFIX + route
        method = httpx.get if route == "/v1/models" else httpx.post
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = method(server.url + path, headers=headers, **({} if method is httpx.get else {"json": body}))
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    for prefix in ("", PREFIX):
        assert httpx.get(server.url + prefix + "/v1/models", headers=AUTH).status_code == 200
        assert post(server, body, prefix + "/v1/completions").status_code == 200
        assert httpx.post(server.url + prefix + "/v1/completions", json=body).status_code == 401
    assert httpx.get(server.url + "/llmx/v1/models", headers=AUTH).status_code == 404  # a prefix is whole segments
    assert httpx.post(server.url + "/tokenize", json={"prompt": "Hi"}, headers=AUTH).json()["count"] >= 1
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200, path
    # Loading took longer than the 5-second stall timeout: no stall for it once ready.
    assert "has not stepped" not in server.logs()


def test_the_chat_template_flag_renders_chats_and_a_key_hides_its_text(server):
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = post(server, {"messages": messages}, "/tokenize").json()["tokens"]
    text = "<<user>>Name a colour.\n<<a>>"
    assert ids == post(server, {"prompt": text, "add_special_tokens": False}, "/tokenize").json()["tokens"]
    r = post(server, {"messages": messages, "max_tokens": 2}, "/v1/chat/completions")
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
    info = httpx.get(server.url + "/ferry/info").json()
    assert info["chat_template"] is None
    assert info["chat_template_sha256"] == hashlib.sha256(TEMPLATE.encode()).hexdigest()


def test_browsers_reach_it_only_from_the_allowed_origins(server):
    """vLLM's CORS flags: the preflight (no key) is answered, and every answer, a 401 too, names the
    allowed origin; another origin's page is told nothing, so its browser keeps the answer from it."""
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(server.url + "/v1/completions", headers={"Origin": APP, **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP, r.headers
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert httpx.options(server.url + "/v1/completions", headers={"Origin": "https://evil.example", **preflight}
                         ).status_code == 400  # fmt: skip
    r = post(server, {"prompt": "Hi", "max_tokens": 1}, headers={"Origin": APP})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    r = httpx.get(server.url + "/v1/models", headers={"Origin": APP})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP
    r = post(server, {"prompt": "Hi", "max_tokens": 1}, headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_request_id_headers_name_the_answer(server):
    """--enable-request-id-headers: the client's X-Request-Id comes back, else a new one, which the
    answer's id carries too."""
    r = post(server, {"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "trace-7"})
    assert r.headers["x-request-id"] == "trace-7" and r.json()["id"] == "cmpl-trace-7"
    for headers in ({}, {"X-Request-Id": "two words"}):  # none, or one that could forge a log line: a new one
        r = post(server, {"prompt": "Hi", "max_tokens": 1}, headers=headers)
        rid = r.headers["x-request-id"]
        assert len(rid) == 32 and r.json()["id"] == f"cmpl-{rid}", headers
    assert httpx.get(server.url + "/health").headers["x-request-id"] != rid
    r = post(server, {"prompt": "Hi", "max_tokens": 1}, headers={"Origin": APP})  # pages may read it
    assert r.headers["access-control-expose-headers"].lower() == "x-request-id"


def test_the_json_flags_take_json():
    from ferry.cli import build_parser

    for bad in ("*", '"*"', "[1]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--allowed-origins", bad])
    args = build_parser().parse_args(["serve", "--allowed-origins", '["*"]'])
    assert args.allowed_origins == ["*"] and args.allowed_methods == ["*"] and not args.allow_credentials
    for bad in ("temperature=0.5", "[1]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--override-generation-config", bad])
    args = build_parser().parse_args(["serve", "--override-generation-config", '{"temperature": 0.5}'])
    assert args.override_generation_config == {"temperature": 0.5}


def test_the_key_comes_from_the_flag_else_ferrys_variable_else_vllms():
    from ferry.entrypoints.openai.serve_command import api_keys_from

    assert api_keys_from(None, {}) is None
    assert api_keys_from(None, {"VLLM_API_KEY": "v"}) == ["v"]  # a deployment moved from `vllm serve`
    assert api_keys_from(None, {"VLLM_API_KEY": "v", "FERRY_API_KEY": "f"}) == ["f"]
    assert api_keys_from(["a", "b"], {"VLLM_API_KEY": "v", "FERRY_API_KEY": "f"}) == ["a", "b"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": "2"}, "n"),
        ({"max_tokens": 10.0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"stream": "true"}, "stream"),
        ({"seed": 1.5}, "seed"),
        ({"top_k": True}, "top_k"),
        ({"logprobs": True}, "logprobs"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop": ["y" * 9000, "z" * 9000]}, "stop"),
        ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
        ({"priority": 5}, "priority"),  # the operator's, unless --allow-client-priority
        ({"cache_salt": ""}, "cache_salt"),
    ],
)
def test_numbers_keep_their_json_types_and_every_multiplier_is_capped(server, extra, param):
    r = post(server, {"prompt": "Hi", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_caps_themselves_are_allowed(server):
    body = {"prompt": "Hi", "max_tokens": 2, "stop": ["qq"] * 64, "logit_bias": {str(i): 0.5 for i in range(300)},
            "temperature": 1, "priority": 0}  # fmt: skip
    r = post(server, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "raw, path",
    [
        (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "/v1/completions"),
        (b'{"prompt": "Hi", "max_tokens": 2, "model": "\\udfff"}', "/v1/completions"),
        (b'{"messages": [{"role": "user", "content": "x\\udc00"}], "max_tokens": 2}', "/v1/chat/completions"),
        (b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}', "/v1/completions"),  # a surrogate in UTF-8 bytes
        (b'{"prompt": "a\xffb", "max_tokens": 2}', "/v1/completions"),
        (b'{"messages": [{"role": "user", "content": "\xc3"}], "max_tokens": 2}', "/v1/chat/completions"),
    ],
)
def test_lone_surrogates_and_invalid_utf8_are_400(server, raw, path):
    r = post(server, raw, path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert post(server, '{"prompt": "a\\ud83d\\ude00b", "max_tokens": 1}'.encode()).status_code == 200  # a pair


def _raw_request(port: int, path: str, body: bytes, headers: dict[str, str]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode())
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    status = int(head.split()[1])
    headers = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(next(v for k, v in headers.items() if k.lower() == b"content-length"))
    while len(rest) < length:
        rest += sock.recv(65536)
    return status, json.loads(rest[:length])


def test_a_30mb_token_body_is_refused_from_its_length_while_health_answers(server):
    ids = list(range(10000, 15000)) * 860  # 4.3M token ids, 30 MB of JSON
    body = json.dumps({"prompt": ids, "max_tokens": 2}).encode()
    assert len(body) > 30_000_000
    sock = _raw_request(server.port, "/v1/completions", body, {"Content-Type": "application/json", **AUTH})
    try:
        half = len(body) // 2
        sock.sendall(body[:half])
        # Half the body is in: the server reads it without holding its event loop.
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
        sock.sendall(body[half:])
        started = time.monotonic()
        status, answer = _read_response(sock)
        refused_in = time.monotonic() - started
    finally:
        sock.close()
    assert status == 400, answer
    assert answer["error"]["param"] == "prompt" and "4300000 tokens" in answer["error"]["message"]
    print(f"30 MB token-id body refused {refused_in * 1000:.0f} ms after its last byte")
    # A text prompt that could never fit is refused without being tokenized.
    r = post(server, {"prompt": "word " * 2_000_000, "max_tokens": 2})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    r = post(server, {"messages": [{"role": "user", "content": "word " * 100_000}]}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert post(server, {"prompt": [[5] * 600, [6]], "max_tokens": 1}).json()["error"]["param"] == "prompt"
    assert idle(server)


def test_cache_salt_keeps_prefix_hits_among_requests_that_share_it(server):
    prompt = "A salted prompt about tide pools, starfish and the moon. " * 4

    def cached(**extra) -> int:
        r = post(server, {"prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") >= 32  # the same tenant hits its own blocks
    assert cached(cache_salt="tenant-b") == 0  # another tenant learns nothing
    assert cached() == 0  # nor does an unsalted request
    assert cached() >= 32


def test_a_stalled_engine_core_fails_its_requests_and_turns_unready_until_it_steps_again(server):
    core = server.core_pid()
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": STORY, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert started.wait(60)
        os.kill(core, signal.SIGSTOP)  # alive, stepping no more
        wait_until(lambda: httpx.get(server.url + "/ready").status_code == 503, "/ready to turn 503")
        assert httpx.get(server.url + "/ready").json()["status"] == "stalled"
        reader.join(60)
        assert not reader.is_alive(), "the in-flight stream hung on a stalled core"
        error = json.loads(lines[-2][len("data: ") :])["error"]
        assert error["code"] == 503 and "has not stepped" in error["message"] and lines[-1] == "data: [DONE]"
        r = post(server, {"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and "has not stepped" in r.json()["error"]["message"]
    finally:
        os.kill(core, signal.SIGCONT)
    wait_until(lambda: httpx.get(server.url + "/ready").status_code == 200, "/ready to turn 200 again")
    wait_until(lambda: idle(server), "the stalled request's KV blocks to be freed")
    assert post(server, {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_queue_limit_holds_under_2000_concurrent_requests():
    """With the core stopped nothing leaves the queue: of 2,000 concurrent requests, exactly
    --max-queue-len get in (each tokenized off the event loop, the window a late check closes)."""
    s = ServerProcess("--max-model-len", "256", "--max-queue-len", "8", "--engine-stall-timeout", "0",
                      env={"VLLM_API_KEY": KEY})  # vLLM's variable, as a moved deployment sets it  # fmt: skip
    core = s.core_pid()
    try:
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 401
        os.kill(core, signal.SIGSTOP)

        async def one(i: int) -> int:
            # Raw HTTP/1.1 over asyncio's streams: httpx's client spent ~7 s of this process's CPU on
            # 2,000 requests, the server's own work ~1 s.
            body = json.dumps({"prompt": f"Request number {i} of many.", "max_tokens": 1}).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                         f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n"
                         "connection: close\r\n\r\n".encode() + body)  # fmt: skip
            status = await reader.readline()  # b"HTTP/1.1 429 Too Many Requests"
            await reader.read()  # the rest, up to the server's close
            writer.close()
            assert status, f"request {i}: the connection closed without a status line"
            return int(status.split()[1])

        async def blast() -> list[int]:
            # (the timeout, as httpx's was, only turns a connection left open into a failure, not a hang)
            tasks = [asyncio.create_task(asyncio.wait_for(one(i), 300)) for i in range(2000)]
            # The admitted ones wait on the stopped core: resume it once the rest are answered
            # (if more got in, fewer are ever answered: the deadline only bounds that failure).
            deadline = time.monotonic() + 600
            while sum(t.done() for t in tasks) < 2000 - 8 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            os.kill(core, signal.SIGCONT)
            return list(await asyncio.gather(*tasks))

        statuses = asyncio.run(blast())
        assert statuses.count(429) == 2000 - 8 and statuses.count(200) == 8, sorted(set(statuses))
        wait_until(lambda: idle(s), "the admitted requests to finish")
    finally:
        os.kill(core, signal.SIGCONT)
        assert s.stop() == 0, s.logs()


def test_request_timeout_aborts_with_504_streamed_or_not():
    s = ServerProcess("--max-model-len", "256", "--request-timeout", "2", "--engine-stall-timeout", "0")
    core = s.core_pid()
    try:
        os.kill(core, signal.SIGSTOP)  # nothing can finish now
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
        with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                "stream": True}) as r:  # fmt: skip
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        assert json.loads(lines[-2][len("data: ") :])["error"]["code"] == 504 and lines[-1] == "data: [DONE]"
        os.kill(core, signal.SIGCONT)
        wait_until(lambda: idle(s) and s.metric("ferry:num_requests_waiting") == 0, "the aborted requests to go")
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        # Prompts count once prefilled (vLLM's): the two that timed out in the queue never were.
        assert s.metric("ferry:prompt_tokens_total") == r.json()["usage"]["prompt_tokens"]
    finally:
        os.kill(core, signal.SIGCONT)
        assert s.stop() == 0, s.logs()


def test_internal_errors_keep_their_text_in_the_log(caplog):
    from ferry.entrypoints.openai.serving import as_openai_error

    err = as_openai_error(RuntimeError("/srv/tenant-b/prompt.txt: no such file"))
    assert err.status == 500 and "tenant-b" not in err.message
    error_id = err.message.split("id ")[1][:12]
    assert error_id in caplog.text and "tenant-b" in caplog.text


def test_an_internal_error_reaches_a_browser_with_its_cors_headers_and_request_id(caplog):
    """An exception no handler takes is answered inside the CORS and X-Request-Id layers (Starlette's
    last-resort 500 is outside them: a page could not read it, nor a log find its id); once a stream
    has started, the connection closes instead of a second answer."""
    from fastapi import FastAPI
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.testclient import TestClient

    from ferry.entrypoints.openai.http_middleware import add_http_middleware
    from ferry.entrypoints.openai.serving import as_openai_error

    app = FastAPI()

    @app.get("/bug")
    async def bug():
        raise RuntimeError("/srv/tenant-b/secret: a bug")

    @app.get("/stream")
    async def stream():
        async def chunks():
            yield b"data: 1\n\n"
            raise RuntimeError("mid-stream")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    def answer(exc: Exception):
        err = as_openai_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    add_http_middleware(app, {"allow_origins": [APP]}, True, answer)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/bug", headers={"Origin": APP, "X-Request-Id": "trace-9"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error", r.text
        assert "tenant-b" not in r.text and "tenant-b" in caplog.text
        assert r.headers["access-control-allow-origin"] == APP and r.headers["x-request-id"] == "trace-9"
    with TestClient(app) as client, pytest.raises(RuntimeError, match="mid-stream"):
        client.get("/stream")  # the stream's 200 was sent: the error is not answered over it
