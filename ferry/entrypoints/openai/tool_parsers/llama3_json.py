"""Llama 3.1-3.3 JSON tool calls (`--tool-call-parser llama3_json`): the whole answer is
`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several apart by `;`."""

from __future__ import annotations

from ferry.entrypoints.openai.tool_parsers.base import ParsedCall, ToolParser, leading_calls

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    marker = _PYTHON_TAG

    def find_start(self, text: str) -> int | None:
        """Calls only open the output: its first non-blank text is `{` or the python tag."""
        body = text.lstrip()
        if body.startswith("{") or body.startswith(_PYTHON_TAG):
            return len(text) - len(body)
        return None

    def hold(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if not body or _PYTHON_TAG.startswith(body) else 0

    def parse_calls(self, region: str, final: bool) -> tuple[list[ParsedCall], str]:
        pos = len(_PYTHON_TAG) if region.startswith(_PYTHON_TAG) else 0
        calls, end = leading_calls(region, pos, separators=";")
        if not calls:
            return [], region  # not tool calls (yet, or after all): the whole answer is content
        return calls, region[end:].lstrip(" \t\n;")  # text after the calls: content
