"""Token usage and first-token time from a response the gateway passed through.

Non-streamed: the JSON body's `usage`. Streamed (SSE): the `usage` of the
chunk that carries one (the client asked for `stream_options.include_usage`);
without it, completion tokens are counted as the chunks that carry text, one
token per chunk as ferry serve sends them, and the prompt stays estimated.
"""

from __future__ import annotations

import json


def _usage_of(obj) -> tuple[int | None, int | None]:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None, None
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (p if isinstance(p, int) else None), (c if isinstance(c, int) else None)


def _has_text(obj) -> bool:
    for choice in obj.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if choice.get("text") or (isinstance(choice.get("delta"), dict) and choice["delta"].get("content")):
            return True
    return False


def sse_events(body: bytes):
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                yield json.loads(line[6:])
            except ValueError:
                continue


def response_usage(body: bytes, streamed: bool) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens); None where the response does not say."""
    if not streamed:
        try:
            return _usage_of(json.loads(body))
        except ValueError:
            return None, None
    prompt = completion = None
    text_chunks = 0
    for event in sse_events(body):
        p, c = _usage_of(event)
        if c is not None:
            prompt, completion = p, c
        if _has_text(event):
            text_chunks += 1
    return prompt, completion if completion is not None else text_chunks


def first_text_chunk(chunk: bytes) -> bool:
    """Whether an SSE chunk carries generated text (the first one marks the first token)."""
    return any(_has_text(e) for e in sse_events(chunk))
