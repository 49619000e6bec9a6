"""Request bodies of the OpenAI API (with vLLM's extra sampling fields) and the error body.

Nothing is silently dropped: a field ferry does not implement is a 400 naming it, unless its
value is null (asks for nothing), it is one of the accepted no-ops in NO_OP_FIELDS (fields that
only label or store a request at OpenAI), or it has the value that asks for nothing (`best_of`
1). A null for a known field that takes none asks for its default (`"n": null`, as OpenAI's
schema allows). Validation is strict: a
number sent as a string (`"n": "64"`) or an integer sent as a float
(`"max_tokens": 10.0`) is refused rather than coerced, so what a gateway counts
is what the worker runs. Floats reject NaN and infinity. Everything a client
can multiply work by has a cap: counts have OpenAI's bounds, `stop` and
`logit_bias`, `bad_words` and `allowed_token_ids` are bounded in number and size, and `precheck_body` bounds prompt
lengths against the model's context before any per-token work.
"""

from __future__ import annotations

import asyncio
import functools
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request

from ferry.sampling_params import InvalidParameterError, RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_N = 128
MAX_PROMPTS = 1024  # prompts in one /v1/completions request
MAX_INT = 2**31 - 1  # token counts: far above any context, far below what msgspec or torch choke on
MAX_STOP_STRINGS = 64  # the detokenizer scans every stop string at every step
MAX_STOP_BYTES = 16 * 1024  # all of a request's stop strings together, UTF-8
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
# allowed_token_ids cross to the core with every prompt and n-sequence of a request, and are checked
# again there: a label set or a digit class, not a vocabulary's worth.
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_BAD_WORDS = 128  # every step checks each (both spellings) against the output's tail
MAX_BAD_WORD_CHARS = 64
MAX_MESSAGES = 16384  # a chat's messages (each renders to at least one token anyway)
MAX_CACHE_SALT = 256
# chat_template_kwargs keys that would let a client swap the template or the rendering itself
# (a client-supplied Jinja template can loop for hours: vLLM's CVE-2025-61620).
FORBIDDEN_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "conversation", "tools", "documents",
                                       "return_dict", "return_tensors", "tokenizer_kwargs", "padding",
                                       "truncation", "max_length", "add_generation_prompt",
                                       "continue_final_message"})  # fmt: skip

Finite = Annotated[float, Field(allow_inf_nan=False)]

MAX_TOOLS = 128  # OpenAI's limit on a request's tools
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
# Accepted and ignored, as vLLM accepts them: they label a request or ask OpenAI to store it, and
# change nothing about the tokens it gets. Any other unknown field with a value is a 400.
NO_OP_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                          "safety_identifier"})  # fmt: skip
# Fields of older vLLM releases or of OpenAI that ferry does not run, with what to use instead.
_INSTEAD = {
    "guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice", "guided_grammar": "structured_outputs.grammar",
    "guided_decoding_backend": "structured_outputs", "functions": "tools", "function_call": "tool_choice",
}  # fmt: skip


class OpenAIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class PromptLimits:
    """The longest prompt this server can take, for checks on the decoded JSON before validation,
    tokenizing or any per-token work (a 30 MB list of token ids is refused from its length)."""

    max_tokens: int  # max_model_len - 1: a prompt must leave room for one generated token
    max_chars: int  # text longer than this cannot tokenize to max_tokens or fewer

    @classmethod
    def of(cls, max_model_len: int, tokenizer) -> "PromptLimits":
        """A token covers at most as many characters as its longest vocabulary entry has (byte-level
        BPE: exactly its bytes); twice that leaves room for normalizers that drop characters."""
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 16
        return cls(max_model_len - 1, 2 * max_model_len * max(longest, 1))


def too_long(what: str, n: int, unit: str, limit: int, max_model_len: int) -> OpenAIError:
    return OpenAIError(400, f"{what} has {n} {unit}, more than a context of {max_model_len} tokens can hold "
                            f"(at most {limit}); shorten it", param=what, code=400)  # fmt: skip


def _text_len(x: Any) -> int:
    return len(x) if isinstance(x, str) else 0


def json_text_len(value: Any) -> int:
    """Characters a template can render from a JSON value (its strings, keys included; one for
    every other value), counted without recursion: a body may nest ~1000 levels deep."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += len(v)
            for k, item in v.items():
                total += _text_len(k)
                stack.append(item)
        elif isinstance(v, list):
            total += 1
            stack.extend(v)
        else:
            total += 1
    return total


# Chat fields besides the messages' content that chat templates render into the prompt: tool
# definitions (as JSON), and per message its name, reasoning and tool calls.
_RENDERED_BODY_FIELDS = ("tools", "functions", "chat_template_kwargs")
_RENDERED_MESSAGE_FIELDS = ("name", "reasoning_content", "tool_calls", "tool_call_id")


class _BodyHead(msgspec.Struct):
    """What `precheck_raw` reads of a body: the model, and the prompt left as its JSON bytes."""

    model: Any = None
    prompt: msgspec.Raw = msgspec.Raw(b"")  # empty when the body has none
    input: msgspec.Raw = msgspec.Raw(b"")  # /v1/embeddings' prompt


_body_head = msgspec.json.Decoder(_BodyHead)


def precheck_raw(raw: bytes, limits_of: Callable[[Any], PromptLimits | None]) -> None:
    """Bound a large body's token-id prompt from its bytes, before it is decoded into Python objects.

    Decoding millions of token ids holds the GIL for a tenth of a second or more (worse on a busy
    machine), in whatever thread it runs, so the event loop stalls for it; reading the body with
    the prompt left raw only scans it. A prompt with no strings in it holds numbers and brackets
    only, so its commas count its ids exactly (one fewer) and its brackets its prompts. Anything
    else (text, a malformed body) is left to the full decode and `precheck_body`.
    `limits_of(model)`: the limits for the body's model (None: unknown, no check)."""
    if len(raw) <= PRECHECK_RAW_BYTES:
        return  # small: decoding costs little
    try:
        head = _body_head.decode(raw)
    except (msgspec.MsgspecError, RecursionError, UnicodeDecodeError):
        return  # the full decode names what is wrong
    prompt = bytes(head.prompt) or bytes(head.input)
    limits = limits_of(head.model) if prompt else None
    if limits is None or b'"' in prompt:
        return
    body = prompt.strip()
    if not body.startswith(b"["):
        return
    total = body.count(b",") + 1  # flat: the ids; nested: the ids of all prompts (commas in and between lists)
    if body[1:].lstrip().startswith(b"["):  # a list of token-id lists
        if body.count(b"[") - 1 > MAX_PROMPTS:
            raise OpenAIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt", code=400)
        # More ids than MAX_PROMPTS full prompts hold: one prompt is too long.
        if total > MAX_PROMPTS * limits.max_tokens:
            why = f"more than {MAX_PROMPTS} prompts of at most {limits.max_tokens} tokens each can"
            raise OpenAIError(400, f"prompt holds {total} token ids in all, {why}; shorten them", param="prompt",
                              code=400)  # fmt: skip
    elif total > limits.max_tokens:
        raise too_long("prompt", total, "tokens", limits.max_tokens, limits.max_tokens + 1)


def precheck_body(data: dict[str, Any], limits: PromptLimits) -> None:
    """Bound the prompt's size on the decoded JSON, before the schema walks it: the number of
    prompts and messages, token-id lists against the context and text against `max_chars` (for
    chat, everything the template renders: content, tool definitions, calls, names, reasoning)."""
    ctx = limits.max_tokens + 1
    prompt = data.get("prompt", data.get("input"))  # /v1/embeddings calls it input
    if isinstance(prompt, str):
        if len(prompt) > limits.max_chars:
            raise too_long("prompt", len(prompt), "characters", limits.max_chars, ctx)
    elif isinstance(prompt, list) and prompt:
        if not isinstance(prompt[0], (str, list)):  # one prompt of token ids
            if len(prompt) > limits.max_tokens:
                raise too_long("prompt", len(prompt), "tokens", limits.max_tokens, ctx)
            return
        if len(prompt) > MAX_PROMPTS:
            raise OpenAIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt", code=400)
        for p in prompt:
            if isinstance(p, list) and len(p) > limits.max_tokens:
                raise too_long("prompt", len(p), "tokens", limits.max_tokens, ctx)
            if isinstance(p, str) and len(p) > limits.max_chars:
                raise too_long("prompt", len(p), "characters", limits.max_chars, ctx)
    messages = data.get("messages")
    if isinstance(messages, list):
        if len(messages) > MAX_MESSAGES:
            raise OpenAIError(400, f"at most {MAX_MESSAGES} messages per request", param="messages", code=400)
        chars = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                # A part counts at least one character: a million empty parts is no free ride.
                chars += sum(max(_text_len(p.get("text") if isinstance(p, dict) else None), 1) for p in content)
            if isinstance(m, dict):
                chars += sum(json_text_len(m[f]) for f in _RENDERED_MESSAGE_FIELDS if m.get(f) is not None)
        chars += sum(json_text_len(data[f]) for f in _RENDERED_BODY_FIELDS if data.get(f) is not None)
        if chars > limits.max_chars:
            raise too_long("messages", chars, "characters", limits.max_chars, ctx)


MAX_BODY_BYTES = 32 << 20
# Bodies above this are decoded and validated in a worker thread. Neither releases the GIL, so
# the loop still pauses, but for a JSON decode (~0.1 s at the cap) rather than for validation.
OFFLOAD_BYTES = 1 << 20
# Bodies over this have their token-id prompts counted from the bytes first (precheck_raw).
PRECHECK_RAW_BYTES = 64 << 10


# The whole body must arrive within this (32 MB at ~0.5 MB/s): a client trickling a byte now and
# then would otherwise hold its connection, and what it sent, for as long as it likes, and enough of
# them would use up the process's sockets (uvicorn bounds neither).
BODY_READ_SECONDS = 60.0


async def read_body(request: Request, timeout: float = BODY_READ_SECONDS) -> bytes:
    """A request's body, refused with a 413 as soon as it passes MAX_BODY_BYTES (declared or streamed)
    and with a 408 if it has not all arrived `timeout` seconds after the headers."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise OpenAIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code=413)
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for piece in request.stream():
                raw += piece
                if len(raw) > MAX_BODY_BYTES:
                    raise OpenAIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code=413)
    except TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {timeout:g} s", code=408) from None
    return bytes(raw)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone away. Only once the body has been read: until then the
    messages it would take are the body's."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a dict: strict UTF-8, no NaN, no lone UTF-16 surrogates (400 otherwise)."""
    try:
        data = msgspec.json.decode(raw)
    except UnicodeDecodeError as e:
        raise OpenAIError(400, f"the request body is not valid UTF-8: {e}", code=400) from None
    except (msgspec.MsgspecError, RecursionError) as e:
        why = str(e) if not isinstance(e, RecursionError) else "nested too deeply"
        if _LONE_SURROGATE.search(raw):
            why = "it contains a lone UTF-16 surrogate escape (\\ud800-\\udfff not part of a pair)"
        raise OpenAIError(400, f"malformed JSON body: {why}", code=400) from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code=400)
    return data


def _error_text(err: dict) -> str:
    where = ".".join(str(p) for p in err.get("loc", ())) or "body"
    if err.get("type") != "extra_forbidden":
        return f"{where}: {err['msg']}"
    field = str(err["loc"][-1]) if err.get("loc") else where
    instead = _INSTEAD.get(field)
    return f"{where}: ferry does not implement `{field}`" + (f"; use `{instead}`" if instead else "")


def validation_error(e: ValidationError) -> OpenAIError:
    """A schema error as OpenAI's 400, naming the first bad field (an unimplemented one by name)."""
    errors = e.errors()
    first = next((err for err in errors if err.get("type") == "extra_forbidden"), errors[0])
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    rest = [err for err in errors if err is not first][:4]
    return OpenAIError(400, "; ".join(_error_text(err) for err in [first, *rest]), param=param, code=400)


def validate_body(data: dict[str, Any], schema: type[BaseModel]) -> Any:
    """`data` as `schema` (CompletionRequest, ChatCompletionRequest), or OpenAI's 400."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise OpenAIError(400, "the request body is nested too deeply", code=400) from None


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """A body model's field names and aliases (once per class: validation runs per message)."""
    return frozenset(model.model_fields.keys() | {f.alias for f in model.model_fields.values() if f.alias})


@functools.cache
def _not_nullable(model: type[BaseModel]) -> frozenset[str]:
    """The fields (names and aliases) whose type has no None: a null there asks for the default."""
    names = set()
    for name, f in model.model_fields.items():
        if f.annotation is not Any and type(None) not in typing.get_args(f.annotation):
            names |= {name, f.alias} - {None}
    return frozenset(names)


class Strict(BaseModel):
    """A body part that names what it does not implement: unknown fields with a value are refused
    (`extra_forbidden`, reported by `validation_error`). Null fields are dropped, and so are nulls
    for known fields that take none: OpenAI's schema makes most fields nullable (`"n": null`,
    `"stream": null` ask for the default, and SDKs send them so). Where a field takes None it keeps
    its meaning (`max_tokens: null`: up to the context, as vLLM reads it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    _no_ops: ClassVar[frozenset[str]] = frozenset()
    # Unknown fields at the value that asks for nothing (OpenAI's default), dropped as no-ops.
    _no_op_values: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_and_no_ops(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields, defaulted = _field_names(cls), _not_nullable(cls)

            def asks_nothing(k: str, v: Any) -> bool:
                if v is None:
                    return k in defaulted or k not in fields
                no_op_value = cls._no_op_values.get(k, _NOTHING)
                return k not in fields and (k in cls._no_ops or _same(v, no_op_value))

            dropped = [k for k, v in data.items() if asks_nothing(k, v)]
            if dropped:
                data = {k: v for k, v in data.items() if k not in dropped}
        return data


_NOTHING = object()


def _same(a: Any, b: Any) -> bool:
    """Equal, and of one type (JSON's `true` is not 1)."""
    return type(a) is type(b) and a == b


class StreamOptions(Strict):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far, not null
    continuous_usage_stats: bool = False
    _no_ops = frozenset({"include_obfuscation"})  # OpenAI's padding against length side channels


def _check_stop(stop: str | list[str] | None) -> str | list[str] | None:
    strings = [stop] if isinstance(stop, str) else stop or []
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in strings)
    if size > MAX_STOP_BYTES:
        raise ValueError(f"stop strings may total at most {MAX_STOP_BYTES} bytes, got {size}")
    return stop


class JSONSchemaFormat(Strict):
    """`response_format.json_schema` (OpenAI): the schema the output must follow."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(pattern=TOOL_NAME)  # OpenAI: a-z, A-Z, 0-9, underscores and dashes, at most 64
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # ferry constrains either way, as vLLM does


class ResponseFormat(Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


class _GenerationRequest(Strict):
    _no_ops = NO_OP_FIELDS

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Finite | None = None
    top_p: Finite | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, AfterValidator(_check_stop)] = None
    seed: int | None = None
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    logit_bias: dict[str, Finite] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)
    min_p: Finite | None = None
    repetition_penalty: Finite | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # lower runs first, as in vLLM
    stop_token_ids: list[int] | None = Field(None, max_length=1024)
    allowed_token_ids: list[int] | None = Field(None, max_length=MAX_ALLOWED_TOKEN_IDS)  # only these sampled
    bad_words: list[Annotated[str, Field(max_length=MAX_BAD_WORD_CHARS)]] | None = Field(None, max_length=MAX_BAD_WORDS)
    # the prompt's last k tokens only (-1: as many as the context holds with room for one generated)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: each prompt token's logprob (and rank) with this many alternatives; the whole prompt is
    # computed (no prefix-cache hits), so it costs a prefill.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_INT)  # the engine holds it to --max-logprobs
    # vLLM's: logprobs name each token `token_id:<id>` (exact, whatever its text); None: the server's
    # --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    # Prefill/decode disaggregation, set by the gateway (vLLM's field name): {"do_remote_decode": true,
    # "decode_receiver": "tcp://..."} to a prefill worker; {"do_remote_prefill": true, "first_token_ids":
    # [...], "prompt_digest": "..."} to a decode worker (entrypoints/openai/serving.py).
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's field: a secret that enters the hash of the prompt's first block, so prefix-cache
    # hits (and the timing and `cached_tokens` they show) happen only among requests sharing it.
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs (not both).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's extras: the n best beams instead of n samples (serving_beam_search.py), scored by their
    # cumulative logprob over their length to the power length_penalty.
    use_beam_search: bool = False
    length_penalty: Finite = Field(1.0, ge=-10.0, le=10.0)

    def structured_output_params(self) -> tuple[StructuredOutputsParams | None, str]:
        """The grammar this request asks for (None: free text) and the field it came from."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise InvalidParameterError("response_format", "send response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            so = self.structured_outputs
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=so.json_object,
                                           disable_any_whitespace=so.disable_any_whitespace,
                                           whitespace_pattern=so.whitespace_pattern), "structured_outputs"  # fmt: skip
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None, ""
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if rf.json_schema is None:
            raise InvalidParameterError("response_format.json_schema", "type json_schema needs a json_schema object")
        schema = rf.json_schema.schema_
        if schema is None:
            return StructuredOutputsParams(json_object=True), "response_format"
        return StructuredOutputsParams(json=schema), "response_format.json_schema.schema"

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:  # fmt: skip
        """`defaults`: the model's for the fields a request leaves unset (models/generation_config.py).
        Raises InvalidParameterError naming the field."""
        d = defaults or {}

        def pick(value, name: str, library_default):
            return value if value is not None else d.get(name, library_default)

        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise InvalidParameterError(
                        "logit_bias", f"logit_bias keys must be token ids, got {key!r}"
                    ) from None
                if not -100.0 <= value <= 100.0:
                    raise InvalidParameterError("logit_bias", f"logit_bias values must be in [-100, 100], got {value}")
                bias[token] = value
        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0),
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            # the model's max_new_tokens caps an explicit one too (vLLM's get_max_tokens: the smallest)
            max_tokens=min((v for v in (max_tokens, d.get("max_tokens")) if v is not None), default=None),
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=bias,
            skip_special_tokens=self.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_output_params()[0],
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's continuous_usage_stats, which needs include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_GenerationRequest):
    _no_op_values = {"best_of": 1}  # OpenAI's default: one candidate per choice (more are not implemented)

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, le=MAX_INT)  # 0: only with echo (the prompt scored)
    logprobs: int | None = Field(None, ge=0, le=MAX_INT)  # the engine holds it to --max-logprobs
    echo: bool = False
    suffix: str | None = None
    # vLLM's extra: also return the prompt's and the completion's token ids in each choice.
    # Unset: only when the model has no tokenizer (--load-format dummy), where the text is empty.
    return_token_ids: bool | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(Strict):
    name: str = Field(max_length=64)
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Strict):
    """An assistant message's call of a tool, as a client sends it back in the conversation."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Strict):
    _no_ops = frozenset({"refusal", "annotations"})  # what OpenAI's own answers carry back

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # assistant
    tool_call_id: str | None = Field(None, max_length=256)  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its reasoning, for templates that render it

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None  # ferry constrains arguments only under tool_choice required or named


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    """`tool_choice` naming the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


class ChatPrompt(Strict):
    """What the chat template renders (chat_prompt.render_chat_prompt): chat completions and
    /tokenize take the same fields."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)


class ChatCompletionRequest(_GenerationRequest, ChatPrompt):
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_INT)  # the engine holds it to --max-logprobs
    # Unset: "auto" when tools are given, else "none" (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeCompletionRequest(Strict):
    """POST /tokenize with a prompt (vLLM's)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPrompt):
    """POST /tokenize with messages: the chat template applied as /v1/chat/completions applies it."""

    model: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    """POST /detokenize (vLLM's); at most a context's worth of tokens (checked by the handler)."""

    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(Strict):
    """POST /v1/embeddings: OpenAI's body, with vLLM's `normalize`, `priority` and
    `truncate_prompt_tokens` (each input's last k tokens embedded; -1: as many as the context holds)."""

    _no_ops = NO_OP_FIELDS

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    normalize: bool = True
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)  # its blocks' hashes, as above


_Texts = str | Annotated[list[str], Field(max_length=MAX_PROMPTS)]


class _ScoringRequest(Strict):
    """What /score and /rerank (serving_score.py) take besides their texts, as /v1/embeddings. Fields
    of Cohere's and Jina's clients that change nothing here are accepted (Cohere's
    `max_tokens_per_doc` and `rank_fields`, `user`)."""

    _no_ops = NO_OP_FIELDS | {"max_tokens_per_doc", "rank_fields"}

    model: str | None = None
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)


class ScoreRequest(_ScoringRequest):
    text_1: _Texts
    text_2: _Texts


class RerankRequest(_ScoringRequest):
    query: str
    documents: list[str] = Field(min_length=1, max_length=MAX_PROMPTS)
    top_n: int = Field(0, ge=0, le=MAX_INT)  # 0: every document
    return_documents: bool = True  # Cohere's: each result carries its document's text
