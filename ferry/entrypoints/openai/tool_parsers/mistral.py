"""Mistral tool calls (`--tool-call-parser mistral`): `[TOOL_CALLS]` then either a JSON list of
{"name", "arguments"} (tokenizers up to v7) or `name{...}` / `name[ARGS]{...}` per call (v11+,
each after its own `[TOOL_CALLS]`)."""

from __future__ import annotations

import re

from ferry.entrypoints.openai.tool_parsers.base import ParsedCall, ToolParser, first_json_value, parsed_call

_NAMED = re.compile(r"\s*([A-Za-z0-9_-]{1,64})(?:\[ARGS\])?")


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def parse_calls(self, region: str, final: bool) -> tuple[list[ParsedCall], str]:
        calls: list[ParsedCall] = []
        content: list[str] = []
        starts = [m.start() for m in re.finditer(re.escape(self.marker), region)]
        for i, at in enumerate(starts):
            part = region[at + len(self.marker) : starts[i + 1] if i + 1 < len(starts) else len(region)]
            found = _part_calls(part)
            if found is None:  # not (yet) calls: from this marker on, the text is content
                content.append(region[at:])
                break
            calls.extend(found[0])
            content.append(found[1])
        return calls, "".join(content)


def _part_calls(part: str) -> tuple[list[ParsedCall], str] | None:
    """The calls of the text after one `[TOOL_CALLS]`, and the text after them; None when it
    holds no complete call."""
    if part.lstrip().startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
        value, end = first_json_value(part, 0)
        found = [parsed_call(v) for v in value] if isinstance(value, list) else []
    else:  # name{...} or name[ARGS]{...}
        m = _NAMED.match(part)
        value, end = first_json_value(part, m.end()) if m else (None, 0)
        found = [parsed_call({"name": m.group(1), "arguments": value})] if end else []
    if not found or any(c is None for c in found):
        return None
    return found, part[end:]
