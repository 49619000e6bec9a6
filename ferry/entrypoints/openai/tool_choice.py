"""What a chat request's `tools` and `tool_choice` ask of generation, and how to read the answer.

- `none` (the default without tools): plain text; the tools are still shown to the template.
- `auto` (the default with tools): the model decides, in its own format; the server's
  `--tool-call-parser` reads calls out of the text. Needs `--enable-auto-tool-choice`.
- `required`: the output is constrained by a grammar to a JSON list of calls,
  `[{"name": <one of the tools>, "parameters": <that tool's schema>}, ...]` (one call without
  `parallel_tool_calls`), so even a small model returns valid calls.
- a named function: the output is constrained to that function's parameters schema; it is the
  call's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ferry.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice, OpenAIError
from ferry.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedCall, ToolParser
from ferry.entrypoints.openai.tool_parsers.base import leading_calls
from ferry.sampling_params import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a tool without a parameters schema


def _parameters(tool) -> dict[str, Any]:
    """A tool's parameters schema as the grammar of its arguments: always an object (OpenAI's
    `arguments` are one; `{}` alone would let the model write `null` or a string)."""
    params = tool.function.parameters
    if params is None:
        return ANY_OBJECT
    if "type" not in params:
        return {**params, "type": "object"}
    if params["type"] != "object":
        raise OpenAIError(400, f"function {tool.function.name!r}: parameters must be a JSON Schema of type "
                          f'"object", got type {json.dumps(params["type"])}', param="tools", code=400)  # fmt: skip
    return params


class RequiredCallsParser(ToolParser):
    """Reads the JSON list the `required` grammar writes; each call once its object closes."""

    name = "required"
    marker = "["

    def find_start(self, text: str) -> int | None:
        return 0

    def parse_calls(self, region: str, final: bool) -> tuple[list[ParsedCall], str]:
        start = region.find("[")
        if start < 0:
            return [], region
        calls, _ = leading_calls(region, start + 1, separators=",", args_keys=("parameters", "arguments"))
        if not calls:
            return [], region  # cut off (max_tokens) inside its first call: the text as it is
        # The grammar writes calls only: after the last complete one comes the list's end, or a
        # call max_tokens cut off (finish_reason "length" says so), which is no content.
        return calls, ""


@dataclass
class ToolPlan:
    """One chat request's tool handling (see the module docstring)."""

    mode: str  # "none" | "auto" | "required" | "named"
    parser: ToolParser | None = None  # auto: the server's; required: RequiredCallsParser
    function: str | None = None  # named: the function to call
    grammar: StructuredOutputsParams | None = None  # required / named: what the output must follow
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


def tool_plan(body: ChatCompletionRequest, tool_parser: str | None, auto_tool_choice: bool) -> ToolPlan:
    """The request's plan; OpenAIError (400) for a choice this server or request cannot take."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise OpenAIError(400, f"tool_choice {_label(choice)} needs tools", param="tool_choice", code=400)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIError(400, "tools must have distinct function names", param="tools", code=400)
    if choice == "required" or isinstance(choice, NamedToolChoice):
        if (body.response_format is not None and body.response_format.type != "text") or (
            body.structured_outputs is not None
        ):  # "text" is the default, asking for nothing
            raise OpenAIError(400, f"tool_choice {_label(choice)} constrains the output itself: send it without "
                              "response_format or structured_outputs", param="tool_choice", code=400)  # fmt: skip
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        if not auto_tool_choice or tool_parser is None:
            raise OpenAIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                              "and --tool-call-parser", param="tool_choice", code=400)  # fmt: skip
        return ToolPlan("auto", parser=TOOL_PARSERS[tool_parser](), parallel=body.parallel_tool_calls)
    if choice == "required":
        calls = [
            {"type": "object", "properties": {"name": {"enum": [t.function.name]}, "parameters": _parameters(t)},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in tools
        ]  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not body.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan("required", parser=RequiredCallsParser(), grammar=StructuredOutputsParams(json=schema),
                        parallel=body.parallel_tool_calls)  # fmt: skip
    tool = next((t for t in tools if t.function.name == choice.function.name), None)
    if tool is None:
        raise OpenAIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                          param="tool_choice", code=400)  # fmt: skip
    return ToolPlan("named", function=tool.function.name, grammar=StructuredOutputsParams(json=_parameters(tool)))


def _label(choice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
