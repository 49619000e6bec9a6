"""One chat choice's text as the assistant's message: reasoning, content and tool calls.

The reasoning parser (reasoning.py) splits off `reasoning_content` first; what is left is content,
from which the request's ToolPlan (tool_choice.py) reads tool calls. Non-streamed, `message`
builds the whole message; streamed, `delta` turns each text delta into an OpenAI delta, where
each tool call arrives in one `delta.tool_calls` entry once it is complete (a named call's
arguments stream as they are written).
"""

from __future__ import annotations

import uuid
from typing import Any

from ferry.entrypoints.openai.reasoning import ReasoningStream, split_reasoning
from ferry.entrypoints.openai.tool_choice import ToolPlan
from ferry.entrypoints.openai.tool_parsers import ParsedCall, ToolCallStream


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    out = {"id": tool_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` when the model stopped after calling tools it chose to call."""
    return "tool_calls" if called and reason == "stop" else reason


def message(text: str, plan: ToolPlan, reasoning_open: bool | None) -> tuple[dict[str, Any], bool]:
    """(the message, whether it calls tools of its own choice: a named tool_choice's forced call
    ends with "stop", as OpenAI's and vLLM's do). `reasoning_open`: None without a reasoning
    parser, else whether the prompt left a `<think>` open."""
    reasoning, content = (None, text) if reasoning_open is None else split_reasoning(text, reasoning_open)
    calls: list[ParsedCall] = []
    if plan.mode == "named":
        calls, content = [ParsedCall(plan.function, content or "")], None
    elif plan.parses_calls:
        content, calls = plan.parser.extract(content or "")
        calls = calls if plan.parallel else calls[:1]
    out: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}  # OpenAI's: nullable, always there
    if reasoning_open is not None:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = [_call(c) for c in calls]
    return out, bool(calls) and plan.mode != "named"


class DeltaBuilder:
    """One streamed choice: text deltas in, OpenAI deltas out."""

    def __init__(self, plan: ToolPlan, reasoning_open: bool | None) -> None:
        self.plan = plan
        self.reasoning = ReasoningStream(reasoning_open) if reasoning_open is not None else None
        self.tools = ToolCallStream(plan.parser) if plan.parser is not None else None
        self.num_calls = 0
        self.named_id: str | None = None

    @property
    def called(self) -> bool:
        """Whether tools of the model's own choice were called (as `message` says)."""
        return self.num_calls > 0 and self.plan.mode != "named"

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta for `text` (empty dict: nothing to send yet); `final` for the choice's last."""
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning is not None else ("", text)
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if self.plan.mode == "named":
            if content or (final and self.named_id is None):
                if self.named_id is None:
                    self.named_id, self.num_calls = tool_call_id(), 1
                    call = {"index": 0, "id": self.named_id, "type": "function",
                            "function": {"name": self.plan.function, "arguments": content}}  # fmt: skip
                else:
                    call = {"index": 0, "function": {"arguments": content}}
                out["tool_calls"] = [call]
            return out
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
            if not self.plan.parallel:
                calls = calls[: max(1 - self.num_calls, 0)]
            if calls:
                out["tool_calls"] = [_call(c, self.num_calls + i) for i, c in enumerate(calls)]
                self.num_calls += len(calls)
        if content:
            out["content"] = content
        return out
