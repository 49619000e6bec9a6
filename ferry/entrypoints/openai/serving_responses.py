"""POST /v1/responses: OpenAI's Responses API over the chat path (responses_protocol.py).

The answer is a list of output items: the reasoning (with a --reasoning-parser), the message's
text, and one `function_call` item per tool call. Streamed, it is OpenAI's typed events:
`response.created`, `response.in_progress`, per item `response.output_item.added`, its deltas
(`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`) and `...done` events, `response.output_item.done`, and
last `response.completed` (or `response.incomplete` when max_output_tokens cut it off), which
carries the whole response with its usage.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ferry.entrypoints.openai.assistant_message import DeltaBuilder, message
from ferry.entrypoints.openai.responses_protocol import ResponsesRequest
from ferry.entrypoints.openai.serving import ServerState, as_openai_error, merged_outputs, until_disconnect
from ferry.entrypoints.openai.serving_chat import ChatRun, chat_logprobs, final_output, start_chat


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex[:24]}"


def _text_part(text: str, logprobs: list | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, text: str, logprobs: list | None, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)] if status != "in_progress" else []}  # fmt: skip


def _reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text is not None else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}  # fmt: skip


def _response(run: ChatRun, body: ResponsesRequest, status: str, output: list, usage: dict | None,
              finish_reason: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The response object; `status` in_progress while streaming, then completed or incomplete."""
    if finish_reason == "length":
        status = "incomplete"
    text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {
        "type": "text"}  # fmt: skip
    tool_choice = body.tool_choice
    return {
        "id": run.reply_id,
        "object": "response",
        "created_at": run.created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": run.model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": body.temperature,
        "text": {"format": text_format},
        "tool_choice": tool_choice.model_dump() if hasattr(tool_choice, "model_dump") else tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": {},
    }


def _item_status(finish_reason: str | None) -> str:
    """The last item's: cut off by max_output_tokens, it is incomplete (as the response is)."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(text: str, run: ChatRun, logprobs: list | None, finish_reason: str | None) -> list[dict[str, Any]]:
    """A finished answer's output items: reasoning, text, then calls."""
    msg, _ = message(text, run.tools, run.reasoning_open)
    items = []
    if msg.get("reasoning_content") is not None:
        items.append(_reasoning_item(_item_id("rs"), msg["reasoning_content"]))
    if msg["content"] or not items and not msg.get("tool_calls"):  # (nothing else said: still a message)
        items.append(_message_item(_item_id("msg"), msg["content"] or "", logprobs))
    for call in msg.get("tool_calls") or ():
        items.append(_call_item(_item_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    items[-1]["status"] = _item_status(finish_reason)
    return items


async def create_response(request: Request, state: ServerState, body: ResponsesRequest):
    chat = body.to_chat()
    run = await start_chat(request, state, chat, "resp")
    if body.stream:
        return StreamingResponse(_stream(request, run, body), media_type="text/event-stream")
    final = await final_output(request, run)
    if final is None:
        return None  # the client went away
    c = final.outputs[0]
    logprobs = chat_logprobs(c, run.top, run.engine.tokenizer)["content"] if body.logprobs else None
    usage = _usage(len(final.prompt_token_ids), len(c.token_ids), final.num_cached_tokens)
    items = output_items(c.text, run, logprobs, c.finish_reason)
    return JSONResponse(_response(run, body, "completed", items, usage, c.finish_reason))


class _EventWriter:
    """The typed events of one streamed response, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


class _OpenItem:
    """The output item being streamed: its kind, id and what it has said so far."""

    def __init__(self, index: int, kind: str, item: dict[str, Any]) -> None:
        self.index, self.kind, self.item = index, kind, item
        self.text = ""


async def _stream(request: Request, run: ChatRun, body: ResponsesRequest) -> AsyncIterator[bytes]:
    emit = _EventWriter()
    builder = DeltaBuilder(run.tools, run.reasoning_open)
    output: list[dict[str, Any]] = []
    logprobs: list | None = [] if body.logprobs else None
    current: _OpenItem | None = None

    def open_item(kind: str, item: dict[str, Any]) -> list[bytes]:
        nonlocal current
        events = close_item()
        current = _OpenItem(len(output), kind, item)
        events.append(emit("response.output_item.added", output_index=current.index, item=item))
        if kind == "message":
            events.append(emit("response.content_part.added", item_id=item["id"], output_index=current.index,
                               content_index=0, part=_text_part("", None)))  # fmt: skip
        return events

    def close_item(status: str = "completed") -> list[bytes]:
        nonlocal current
        if current is None:
            return []
        at, item_id, text = current.index, current.item["id"], current.text
        events = []
        if current.kind == "message":
            part = _text_part(text, logprobs)
            events.append(emit("response.output_text.done", item_id=item_id, output_index=at, content_index=0,
                               text=text, logprobs=logprobs or []))  # fmt: skip
            events.append(emit("response.content_part.done", item_id=item_id, output_index=at, content_index=0,
                               part=part))  # fmt: skip
            item = _message_item(item_id, text, logprobs, status)
        elif current.kind == "reasoning":
            events.append(emit("response.reasoning_text.done", item_id=item_id, output_index=at, content_index=0,
                               text=text))  # fmt: skip
            item = _reasoning_item(item_id, text, status)
        else:
            item = {**current.item, "arguments": text, "status": status}
            events.append(emit("response.function_call_arguments.done", item_id=item_id, output_index=at,
                               name=item["name"], arguments=text))  # fmt: skip
        events.append(emit("response.output_item.done", output_index=at, item=item))
        output.append(item)
        current = None
        return events

    def add_text(kind: str, delta: str, delta_logprobs: list | None = None) -> list[bytes]:
        events = []
        if current is None or current.kind != kind:
            item_id = _item_id("msg" if kind == "message" else "rs")
            item = _message_item(item_id, "", None, "in_progress") if kind == "message" else {
                "type": "reasoning", "id": item_id, "summary": [], "content": [], "status": "in_progress"}  # fmt: skip
            events += open_item(kind, item)
        current.text += delta
        at, item_id = current.index, current.item["id"]
        if kind == "message":
            events.append(emit("response.output_text.delta", item_id=item_id, output_index=at, content_index=0,
                               delta=delta, logprobs=delta_logprobs or []))  # fmt: skip
        else:
            events.append(emit("response.reasoning_text.delta", item_id=item_id, output_index=at, content_index=0,
                               delta=delta))  # fmt: skip
        return events

    def add_call(entry: dict[str, Any]) -> list[bytes]:
        events = []
        function = entry.get("function", {})
        if "id" in entry:  # a new call
            item = _call_item(_item_id("fc"), entry["id"], function["name"], "", "in_progress")
            events += open_item("function_call", item)
        arguments = function.get("arguments") or ""
        if arguments and current is not None:
            current.text += arguments
            events.append(emit("response.function_call_arguments.delta", item_id=current.item["id"],
                               output_index=current.index, delta=arguments))  # fmt: skip
        return events

    yield emit("response.created", response=_response(run, body, "in_progress", [], None))
    yield emit("response.in_progress", response=_response(run, body, "in_progress", [], None))
    prompt_tokens, output_tokens, cached, finish = 0, 0, 0, None
    # Each text delta carries its tokens' logprobs, as OpenAI's do; the tokens of text the delta builder
    # holds back (a tag or marker not yet complete) go with the next message text. (The done events
    # carry every output token's, reasoning's included, as the unstreamed response does.)
    held: list = []
    try:
        async for _, out in until_disconnect(request, merged_outputs(run.engine, run.streams, run.log), run.due):
            prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
            for c in out.outputs:
                output_tokens += len(c.token_ids)
                new_logprobs = []
                if logprobs is not None and c.logprobs:
                    new_logprobs = chat_logprobs(c, run.top, run.engine.tokenizer)["content"]
                    logprobs += new_logprobs
                delta = builder.delta(c.text, final=c.finish_reason is not None)
                finish = c.finish_reason or finish
                events: list[bytes] = []
                if delta.get("reasoning_content"):
                    events += add_text("reasoning", delta["reasoning_content"])
                if delta.get("content"):
                    events += add_text("message", delta["content"], held + new_logprobs)
                    held = []
                elif delta.get("reasoning_content") or delta.get("tool_calls"):
                    held = []  # the tokens of reasoning or of a call, not of the message's text
                else:
                    held += new_logprobs
                for entry in delta.get("tool_calls") or ():
                    events += add_call(entry)
                for e in events:
                    yield e
        if not output and current is None:  # nothing said at all: still one (empty) message
            for e in open_item("message", _message_item(_item_id("msg"), "", None, "in_progress")):
                yield e
        for e in close_item(_item_status(finish)):
            yield e
        done = _response(run, body, "completed", output, _usage(prompt_tokens, output_tokens, cached), finish)
        yield emit(f"response.{done['status']}", response=done)
    except Exception as e:  # headers are sent: report in-band
        err = as_openai_error(e)
        failed = _response(run, body, "failed", output, None)
        failed["error"] = {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}
        yield emit("response.failed", response=failed)
