"""Tool-call parsers (`--tool-call-parser NAME`): read the tool calls a model wrote in its own
format out of its text, for `tool_choice: "auto"`."""

from __future__ import annotations

from ferry.entrypoints.openai.tool_parsers.base import ParsedCall, ToolCallStream, ToolParser
from ferry.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from ferry.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from ferry.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolCallStream", "ToolParser"]
