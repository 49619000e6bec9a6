"""What every tool-call parser shares: the call it finds, and streaming it out of growing text.

A parser finds where a model's tool calls begin in its output (a marker such as `<tool_call>`)
and reads the calls from there. `extract` splits a finished output into content and calls;
`ToolCallStream` does the same for a stream: text before the calls streams as content (holding
back a tail that may be the start of the marker), and each call goes out once it is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def json_or_none(text: str) -> Any:
    """`text` decoded, or None where it is not JSON: malformed, or nested deeper than Python's
    parser goes (a RecursionError, not a ValueError: a model can be steered into writing ~1000
    brackets, and a client can send them as a call's arguments)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def parsed_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """A call from a decoded JSON object {"name": ..., "arguments" | "parameters": {...}}, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        args = json_or_none(args)
    if not isinstance(args, dict):
        return None
    try:
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
    except RecursionError:  # decoded a few frames up the stack, at the parser's limit
        return None


_decoder = json.JSONDecoder()


def first_json_value(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value at `text[pos]` (after whitespace) and where it ends; (None, 0) when there is
    no complete one there."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _decoder.raw_decode(text, pos)
    except (json.JSONDecodeError, RecursionError):
        return None, 0


def leading_calls(
    text: str, pos: int, separators: str = ",;", args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[list[ParsedCall], int]:
    """The calls among the JSON values that follow each other from `text[pos]`, apart by whitespace
    and any of `separators`, up to the first value that is not a call or not (yet) complete; and
    where the text after the last of them starts (`pos` when there is none)."""
    calls, end = [], pos
    while True:
        p = end
        while p < len(text) and (text[p].isspace() or text[p] in separators):
            p += 1
        value, after = first_json_value(text, p)
        call = parsed_call(value, args_keys) if after else None
        if call is None:
            return calls, end
        calls.append(call)
        end = after


def marker_prefix_len(text: str, marker: str) -> int:
    """How many of `text`'s last characters are a proper prefix of `marker` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Finds the tool calls in a model's output. Subclasses set `name` and `marker` and read the
    calls after it (`parse_calls`)."""

    name: ClassVar[str]
    marker: ClassVar[str]  # what opens the tool calls

    def find_start(self, text: str) -> int | None:
        """Where the calls begin in `text`, or None (not yet, or never)."""
        i = text.find(self.marker)
        return i if i >= 0 else None

    def hold(self, text: str) -> int:
        """Characters at the end of `text` (no calls found in it yet) that may begin them."""
        return marker_prefix_len(text, self.marker)

    def parse_calls(self, region: str, final: bool) -> tuple[list[ParsedCall], str]:
        """The complete calls in `region` (the output from `find_start` on), and the text in it
        that is not a call (content; only meaningful when `final`). A call found once is found
        again in any longer region, and never counts as content: a stream sends each call as it
        completes (ToolCallStream), and must end with the calls and content `extract` finds."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A finished output as (content, calls); content None when nothing but calls is left."""
        start = self.find_start(text)
        if start is None:
            return text, []
        calls, rest = self.parse_calls(text[start:], final=True)
        content = text[:start] + rest
        return (content if content.strip() else None), calls


class ToolCallStream:
    """One streamed choice's content and calls, from its text deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.start: int | None = None  # where the calls begin, once seen
        self.num_calls = 0  # calls sent

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
        """(content to send now, calls completed now) after `delta`; `final` on the last."""
        self.text += delta
        text, content = self.text, ""
        if self.start is None:
            start = self.parser.find_start(text)
            if start is None:
                end = len(text) if final else len(text) - self.parser.hold(text)
                content, self.sent = text[self.sent : end], max(self.sent, end)
                return content, []
            content, self.sent, self.start = text[self.sent : start], start, start
        elif not final and not any(c in delta for c in "}]>"):  # no call can have closed
            return content, []
        calls, rest = self.parser.parse_calls(text[self.start :], final)
        new, self.num_calls = calls[self.num_calls :], max(self.num_calls, len(calls))
        if final:
            content += rest
        return content, new
