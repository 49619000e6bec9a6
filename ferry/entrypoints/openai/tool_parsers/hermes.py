"""Hermes-style tool calls (`--tool-call-parser hermes`): Hermes 2/3, Qwen2.5, Qwen3 and others
write each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import re

from ferry.entrypoints.openai.tool_parsers.base import ParsedCall, ToolParser, json_or_none, parsed_call

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"

    def parse_calls(self, region: str, final: bool) -> tuple[list[ParsedCall], str]:
        calls, rest, pos = [], [], 0
        for m in _CALL.finditer(region):
            call = _call(m.group(1))
            rest.append(region[pos : m.start()] if call else region[pos : m.end()])
            if call:
                calls.append(call)
            pos = m.end()
        tail = region[pos:]
        # A last call the output ended inside (max_tokens, or a model that stops before the tag).
        open_at = tail.find(self.marker)
        if final and open_at >= 0 and (call := _call(tail[open_at + len(self.marker) :])):
            calls.append(call)
            tail = tail[:open_at]
        rest.append(tail)
        return calls, "".join(rest)


def _call(body: str) -> ParsedCall | None:
    return parsed_call(json_or_none(body))
