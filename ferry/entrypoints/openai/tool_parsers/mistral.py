"""Mistral tool calls (`--tool-call-parser mistral`): `[TOOL_CALLS]` then either a JSON list of
{"name", "arguments"} (tokenizers up to v7) or `name{...}` / `name[ARGS]{...}` per call (v11+,
each after its own `[TOOL_CALLS]`)."""

from __future__ import annotations

import re

from ferry.entrypoints.openai.tool_parsers.base import ParsedCall, ToolParser, json_values, parsed_call

_NAMED = re.compile(r"\s*([A-Za-z0-9_-]{1,64})(?:\[ARGS\])?")


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def parse_calls(self, region: str, final: bool) -> tuple[list[ParsedCall], str]:
        calls: list[ParsedCall] = []
        for part in region.split(self.marker)[1:]:
            body = part.lstrip()
            if body.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
                values, end = json_values(body, 0)
                if not values or not isinstance(values[0], list) or body[end:].strip():
                    return ([], region) if final else (calls, "")
                found = [parsed_call(v) for v in values[0]]
            else:  # name{...}
                m = _NAMED.match(part)
                values, end = json_values(part, m.end()) if m else ([], 0)
                if not m or len(values) != 1 or part[end:].strip():
                    return ([], region) if final else (calls, "")
                found = [parsed_call({"name": m.group(1), "arguments": values[0]})]
            if any(c is None for c in found):
                return ([], region) if final else (calls, "")
            calls.extend(found)
        return calls, ""
