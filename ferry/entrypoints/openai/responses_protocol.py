"""POST /v1/responses' request body (OpenAI's Responses API), and the chat request it runs as.

A Responses request is a chat in other words: `instructions` is a system message, `input` a
string or a list of items (messages, the function calls a model made and their outputs), `tools`
are flat function definitions, `text.format` is `response_format`, `max_output_tokens` is
`max_completion_tokens`. `to_chat` rewrites it so, and the chat path checks, renders and runs it
(serving_responses.py answers in the Responses shapes).

Stateless, as vLLM is by default: nothing is stored, so `previous_response_id` is refused (send
the conversation in `input`; agent libraries do) and `store` is accepted and ignored.
Only function tools: OpenAI's hosted tools (web search, file search, computer use) are its own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from ferry.entrypoints.openai.protocol import (
    MAX_CACHE_SALT,
    MAX_INT,
    MAX_MESSAGES,
    MAX_TOOLS,
    TOOL_NAME,
    ChatCompletionRequest,
    Finite,
    OpenAIError,
    PromptLimits,
    Strict,
    json_text_len,
    too_long,
    validate_body,
)

# Items the Responses API echoes back that a client replays in its next `input`: their ids and
# statuses label them, and change nothing.
_ITEM_LABELS = frozenset({"id", "status"})


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    """An earlier answer's text, replayed (its annotations and logprobs are dropped)."""

    type: Literal["output_text"]
    text: str
    _no_ops = frozenset({"annotations", "logprobs"})


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentPart]  # a string is one part (so a bad part's error names just the part)
    _no_ops = _ITEM_LABELS

    @field_validator("content", mode="before", json_schema_input_type=str | list[ContentPart])
    @classmethod
    def _string_is_one_part(cls, v: Any) -> Any:
        return [{"type": "input_text", "text": v}] if isinstance(v, str) else v

    def text(self) -> str:
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class FunctionCallItem(Strict):
    """A call the model made, replayed so the model sees what it asked for."""

    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str = Field(max_length=64)
    arguments: str
    _no_ops = _ITEM_LABELS


class FunctionCallOutputItem(Strict):
    """What the client's function returned."""

    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str | list[InputText]
    _no_ops = _ITEM_LABELS

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    """An earlier answer's reasoning, replayed: rendered as its assistant message's reasoning."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    _no_ops = _ITEM_LABELS | {"encrypted_content"}

    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")  # OpenAI's "easy" input messages have no type
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(Strict):
    type: Literal["function"]  # only function tools: hosted ones (web_search, ...) are OpenAI's own
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=TOOL_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    _no_ops = frozenset({"verbosity"})


class ReasoningConfig(Strict):
    """Accepted and ignored: a reasoning model here thinks as its template has it."""

    _no_ops = frozenset({"effort", "summary", "generate_summary"})


class ResponsesStreamOptions(Strict):
    _no_ops = frozenset({"include_obfuscation"})  # OpenAI's padding against length side channels


LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What `include` may ask for: the answer's logprobs; encrypted reasoning is never made (there is
# nothing to hide from the client that runs the model), so asking for it asks for nothing.
_INCLUDES = Literal["message.output_text.logprobs", "reasoning.encrypted_content"]


class ResponsesRequest(Strict):
    model: str | None = None
    input: list[InputItem] = Field(max_length=MAX_MESSAGES)  # a string is one user message
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: Finite | None = None
    top_p: Finite | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[_INCLUDES] | None = Field(None, max_length=8)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_INT)  # the engine holds it to --max-logprobs
    # vLLM's extras, as on the chat endpoint
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)
    min_p: Finite | None = None
    repetition_penalty: Finite | None = None
    seed: int | None = None
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)
    # Labels, storage and caching hints, and the cap on hosted tools' calls (there are none here).
    _no_ops = frozenset({"store", "metadata", "user", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                         "prompt_cache_options", "safety_identifier", "max_tool_calls"})  # fmt: skip
    _no_op_values = {"truncation": "disabled", "background": False}

    @field_validator("input", mode="before", json_schema_input_type=str | list[InputItem])
    @classmethod
    def _string_is_a_user_message(cls, v: Any) -> Any:
        return [{"role": "user", "content": v}] if isinstance(v, str) else v

    @property
    def include_usage(self) -> bool:
        """A stream's usage comes with it, always: in its last event's response."""
        return True

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one is (OpenAIError naming a field when it cannot be one)."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        reasoning = None  # a replayed reasoning item: the next assistant message's
        for item in self.input:
            last = messages[-1] if messages else None
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
            elif isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                msg = {"role": role, "content": item.text()}
                if role == "assistant" and reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                messages.append(msg)
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                if last is not None and last["role"] == "assistant":  # its text, then its calls: one turn
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    if reasoning is not None:
                        messages[-1]["reasoning_content"], reasoning = reasoning, None
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        if not messages:
            raise OpenAIError(400, "input holds no message", param="input", code=400)
        chat: dict[str, Any] = {
            "model": self.model, "messages": messages, "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed, "priority": self.priority,
            "cache_salt": self.cache_salt,
        }  # fmt: skip
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        if self.tools is not None:
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]  # fmt: skip
        if isinstance(self.tool_choice, FunctionChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        else:
            chat["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.name is None:
                raise OpenAIError(400, "text.format of type json_schema needs a name", param="text.format.name",
                                  code=400)  # fmt: skip
            schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            chat["response_format"] = {"type": fmt.type}
        if self.logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, self.top_logprobs
        elif self.top_logprobs:
            raise OpenAIError(400, f'top_logprobs needs include ["{LOGPROBS_INCLUDE}"]', param="top_logprobs",
                              code=400)  # fmt: skip
        return validate_body(chat, ChatCompletionRequest)


def precheck_responses(data: dict[str, Any], limits: PromptLimits) -> None:
    """Bound what the template renders (input items, instructions, tools) before the schema walks
    it, as `precheck_body` bounds a chat's messages."""
    items = data.get("input")
    if isinstance(items, list) and len(items) > MAX_MESSAGES:
        raise OpenAIError(400, f"at most {MAX_MESSAGES} input items per request", param="input", code=400)
    chars = sum(json_text_len(data[f]) for f in ("input", "instructions", "tools") if data.get(f) is not None)
    if chars > limits.max_chars:
        raise too_long("input", chars, "characters", limits.max_chars, limits.max_tokens + 1)
