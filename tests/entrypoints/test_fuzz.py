"""Schema fuzzing: bodies generated from the server's own /openapi.json (hypothesis strategies built
from its JSON schema by `_from_schema`, which covers the keywords pydantic emits), valid ones and
mutated ones, sent to a real server and through a real gateway in front of it.
Nothing may answer 5xx or hang, and afterwards the worker is idle with no KV block held.

Valid bodies are kept cheap (a few tokens, n <= 2) by tightening the schema's maxima, so the
examples' time goes into breadth; the cap checks themselves are tested in test_server_hardening."""

from __future__ import annotations

import copy
import json
import string

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import GatewayProcess, ServerProcess, wait_for

MODEL = "smol"
MAX_MODEL_LEN = 128
# Tightened maxima: what a valid body may ask for here (the schema's own caps are far larger).
CHEAP = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "min_tokens": 4, "n": 2, "best_of": 2,
         "logprobs": 3, "top_logprobs": 3}  # fmt: skip
PATHS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
         "/v1/responses": "ResponsesRequest"}  # fmt: skip
# Each body's token budget (the Responses API names it otherwise).
BUDGET = {"ResponsesRequest": ("max_output_tokens",)}


@pytest.fixture(scope="module")
def fuzzed():
    server = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64", "--max-num-seqs", "8",
                           "--served-model-name", MODEL, "--engine-stall-timeout", "0")  # fmt: skip
    gateway = GatewayProcess([server.url])
    yield server, gateway
    gateway.stop()
    server.stop()


def _cheap(schema, name: str | None = None):
    """`schema` with every integer under a CHEAP field capped, and `model` fixed to ours or null."""
    if isinstance(schema, dict):
        out = {k: _cheap(v, name) for k, v in schema.items() if k != "properties"}
        if name in CHEAP and schema.get("type") == "integer":
            out["maximum"] = min(schema.get("maximum", CHEAP[name]), CHEAP[name])
        if "properties" in schema:
            out["properties"] = {k: _cheap(v, k) for k, v in schema["properties"].items()}
            if "model" in out["properties"]:
                out["properties"]["model"] = {"anyOf": [{"const": MODEL}, {"type": "null"}]}
        return out
    if isinstance(schema, list):
        return [_cheap(v, name) for v in schema]
    return schema


def _from_schema(schema: dict, components: dict):
    """A strategy for the JSON values `schema` accepts (the subset of JSON Schema pydantic emits)."""
    if not isinstance(schema, dict):  # `true`: anything
        return JUNK
    if "$ref" in schema:
        return st.deferred(lambda: _from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components))
    if "anyOf" in schema or "oneOf" in schema:  # (a discriminated union's oneOf: its members differ by tag)
        return st.one_of([_from_schema(s, components) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**70 + 1) - 1)
        return st.integers(schema.get("minimum", -(2**70)), high)
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum", schema.get("exclusiveMaximum")),
                         exclude_max="exclusiveMaximum" in schema, allow_nan=False, allow_infinity=False)  # fmt: skip
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 24), 24))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(_from_schema(schema.get("items", {}), components), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))  # fmt: skip
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        props = {k: _from_schema(v, components) for k, v in schema["properties"].items()}
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items() if k not in required})  # fmt: skip
    if kind == "object":
        values = _from_schema(schema.get("additionalProperties", {}), components)
        return st.dictionaries(st.text(max_size=6), values, max_size=min(schema.get("maxProperties", 4), 4))
    return JUNK  # no constraint: any JSON value


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def _bounded(body: dict, name: str) -> dict:
    """A valid body that leaves out its token budget gets one of CHEAP's: the server's default is the rest
    of the context for chat (~100 tokens of this 128-token one, ~0.8 s a body) and 16 for completions.
    (Mutations may still drop it.)"""
    budget = BUDGET.get(name, ("max_tokens", "max_completion_tokens"))
    if all(body.get(f) is None for f in budget):
        body = {**body, budget[0]: CHEAP[budget[0]]}
    return body


def _strategy(doc: dict, name: str):
    components = _cheap(copy.deepcopy(doc["components"]["schemas"]))
    valid = _from_schema(components[name], components).map(lambda b: _bounded(b, name))
    fields = sorted(doc["components"]["schemas"][name]["properties"]) + ["", "unknown_field"]

    @st.composite
    def mutated(draw):
        body = dict(draw(valid))
        for _ in range(draw(st.integers(1, 3))):
            field = draw(st.sampled_from(fields))
            if draw(st.booleans()) and field in body:
                del body[field]
            else:
                body[field] = draw(JUNK)
        return json.dumps(body).encode()

    raw = st.one_of(
        st.binary(max_size=64),
        st.text(alphabet=string.printable + "\ud7ff\ue000\uffff", max_size=64).map(
            lambda t: t.encode("utf-8", "replace")
        ),
        valid.map(lambda b: json.dumps(b).encode()[: max(1, len(json.dumps(b)) // 2)]),  # cut short
    )
    return st.one_of(valid.map(lambda b: json.dumps(b).encode()), mutated(), raw)


def _check(http: httpx.Client, url: str, body: bytes) -> int:
    """The status of `body` posted to `url`, after checking the answer is well-formed."""
    r = http.post(url, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert "error" in r.json(), r.text[:300]
    elif r.headers["content-type"].startswith("text/event-stream"):
        if url.endswith("/v1/responses"):  # typed events, the last one the whole response
            last = json.loads(r.text.rstrip().rsplit("data: ", 1)[1])
            assert last["type"] in ("response.completed", "response.incomplete"), r.text[-300:]
        else:
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.json().get("choices" if not url.endswith("/v1/responses") else "output"), r.text[:300]
    return r.status_code


@pytest.mark.parametrize("path", PATHS)
def test_fuzzed_bodies_never_5xx_and_leave_the_worker_idle(fuzzed, path):
    server, gateway = fuzzed
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert doc["paths"][path]["post"]["requestBody"]["required"] is True  # the schema clients see
    bodies = _strategy(doc, PATHS[path])
    sent = {"server": 0, "gateway": 0}
    served = 0  # bodies that ran (200): the valid ones must not all be refused
    with httpx.Client(timeout=120) as http:

        @settings(max_examples=1000, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(body=bodies, via_gateway=st.booleans())
        def one(body: bytes, via_gateway: bool) -> None:
            nonlocal served
            target = gateway if via_gateway else server
            served += _check(http, target.url + path, body) == 200
            sent["gateway" if via_gateway else "server"] += 1

        one()
    assert min(sent.values()) >= 200 and served >= 16, (sent, served)  # 1,000 bodies a path

    def idle() -> bool:
        gauges = ("ferry:num_requests_running", "ferry:num_requests_waiting", "ferry:kv_cache_usage_perc")
        return all(server.metric(m) == 0 for m in gauges)

    wait_for(idle, "the worker idle after the fuzzing")
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_the_gateway_bounds_prompts_before_validation(fuzzed):
    """The gateway refuses a prompt longer than the worker's context from its decoded length, as
    the worker does, before walking it with the schema or tokenizing it."""
    _, gateway = fuzzed
    for body in ({"model": MODEL, "prompt": list(range(MAX_MODEL_LEN))},
                 {"model": MODEL, "prompt": [1] * 3_000_000}):  # fmt: skip
        r = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "more than a context of 128 tokens" in r.json()["error"]["message"], r.text
        assert "x-ferry-worker" not in r.headers  # refused by the gateway itself, not passed on
