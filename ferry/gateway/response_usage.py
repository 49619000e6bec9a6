"""Token usage and first-token time from a response the gateway passed through.

Non-streamed: the JSON body's `usage` (the Responses API's names its counts
input_tokens and output_tokens). Streamed (SSE): the `usage` of the
choice-less chunk that ends a stream asked for `stream_options.include_usage`, or
of the response in a Responses API stream's last event (`response.completed`)
(with vLLM's continuous_usage_stats the other chunks carry one choice's usage
so far: not the request's, and a stream cut short by an error ends at one of
them); without it, completion tokens are counted from the chunks that carry
text (a lower bound, for metrics only: the rate limiter keeps its estimate).
"""

from __future__ import annotations

import json

# A Responses API stream's last event: the whole response, with its usage.
_FINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete")
# Its events that carry generated text (the first one marks the first token).
_RESPONSE_TEXT_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta",
                         "response.function_call_arguments.delta")  # fmt: skip


def _usage_of(obj) -> tuple[int | None, int | None]:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None, None
    p = usage.get("prompt_tokens", usage.get("input_tokens"))
    c = usage.get("completion_tokens", usage.get("output_tokens"))
    total = usage.get("total_tokens")
    if c is None and isinstance(p, int) and isinstance(total, int):  # embeddings report no completion
        c = total - p
    if p is None and c is None and isinstance(total, int):  # /rerank reports its total only: all prompt
        p, c = total, 0
    return (p if isinstance(p, int) else None), (c if isinstance(c, int) else None)


def _text_choices(obj) -> int:
    if isinstance(obj, dict) and obj.get("type") in _RESPONSE_TEXT_EVENTS:
        return 1 if obj.get("delta") else 0
    n = 0
    for choice in obj.get("choices") or [] if isinstance(obj, dict) else []:
        if not isinstance(choice, dict):
            continue
        if choice.get("text") or (isinstance(choice.get("delta"), dict) and choice["delta"].get("content")):
            n += 1
    return n


def _has_text(obj) -> bool:
    return _text_choices(obj) > 0


def sse_events(body: bytes):
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                yield json.loads(line[6:])
            except ValueError:
                continue


def response_usage(body: bytes, streamed: bool) -> tuple[int | None, int | None, bool]:
    """(prompt_tokens, completion_tokens, exact): exact when the response reported its usage;
    otherwise completion tokens are counted (one per choice per text chunk: a chunk may carry
    more than one token, so it is a lower bound) and the prompt is None."""
    if not streamed:
        try:
            p, c = _usage_of(json.loads(body))
        except ValueError:
            return None, None, False
        return p, c, c is not None
    text_chunks = 0
    for event in sse_events(body):
        if event.get("type") in _FINAL_RESPONSE_EVENTS:
            p, c = _usage_of(event.get("response"))
            if c is not None:
                return p, c, True
        p, c = _usage_of(event)
        if c is not None and event.get("choices") == []:
            return p, c, True
        text_chunks += _text_choices(event)
    return None, text_chunks, False


class StreamEnd:
    """Whether a passed-through stream has sent its last event: a chat's or completion's ends with
    `data: [DONE]`, a Responses API stream with its response.completed / .incomplete / .failed event
    (which carries the whole response, so it may span chunks; JSON holds no raw newline, so the
    blank line after it ends it). Chunks are cut anywhere, a marker or the blank line too: each is
    looked for in the previous chunk's tail and this one together. LF or CRLF lines."""

    _FINAL = tuple(b"event: " + t.encode() + eol for t in (*_FINAL_RESPONSE_EVENTS, "response.failed")
                   for eol in (b"\n", b"\r\n"))  # fmt: skip
    _KEEP = max(len(m) for m in _FINAL)

    def __init__(self) -> None:
        self.final_started = False
        self.tail = b""

    def feed(self, chunk: bytes) -> bool:
        window = self.tail + chunk
        self.tail = window[-self._KEEP :]
        if not self.final_started and any(marker in window for marker in self._FINAL):
            self.final_started = True
        if window.rstrip().endswith(b"data: [DONE]"):
            return True
        return self.final_started and (window.endswith(b"\n\n") or window.endswith(b"\r\n\r\n"))


def has_error_event(body: bytes) -> bool:
    """Whether a streamed body reports an error in-band (ferry serve does, mid-stream)."""
    return any(isinstance(e, dict) and ("error" in e or e.get("type") == "response.failed") for e in sse_events(body))


def first_text_chunk(chunk: bytes) -> bool:
    """Whether an SSE chunk carries generated text (the first one marks the first token)."""
    return any(_has_text(e) for e in sse_events(chunk))


# What a worker appends to every other chunk of a stream that asked for usage (OpenAI's null field).
_NULL_USAGE = b',"usage":null}\n\n'


class UsageChunkFilter:
    """Drops the usage-only SSE event (`"choices": []` with `usage`), and the other events' `"usage":
    null`, from a stream on its way to a client that did not ask for usage: the gateway asks every
    worker for it, to settle charges, and the client gets the bytes it would have got without."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        out = []
        while (end := self._buf.find(b"\n\n")) >= 0:
            event, self._buf = self._buf[: end + 2], self._buf[end + 2 :]
            if not _usage_only(event):
                out.append(event[: -len(_NULL_USAGE)] + b"}\n\n" if event.endswith(_NULL_USAGE) else event)
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest


def _usage_only(event: bytes) -> bool:
    if not event.startswith(b"data: {") or b'"usage"' not in event:
        return False
    try:
        obj = json.loads(event[6:])
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict)
