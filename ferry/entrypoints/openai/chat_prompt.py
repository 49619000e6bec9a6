"""A chat request's messages through the model's chat template: the prompt text and its token ids.

One renderer for every path that turns messages into a prompt: chat completions and /tokenize
(serving_chat.py, serving_tokenization.py), the gateway's prompt hashing (gateway/prompts.py,
which must see the tokens the worker will) and `LLM.chat`. Messages follow OpenAI's shapes
(content parts, `developer`, assistant `tool_calls`, `tool` messages), put the way Hugging Face
templates take them.
"""

from __future__ import annotations

from typing import Any

from ferry.entrypoints.openai.protocol import FORBIDDEN_TEMPLATE_KWARGS, ChatPrompt, OpenAIError
from ferry.entrypoints.openai.tool_parsers.base import json_or_none


def _arguments(text: str) -> Any:
    """A call's arguments as chat templates expect them: the object (its JSON text if it is none)."""
    value = json_or_none(text)
    return value if isinstance(value, dict) else text


def _conversation(body: ChatPrompt) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (HF's conventions for tool calls)."""
    out = []
    for i, m in enumerate(body.messages):
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.role == "tool":
            if m.tool_call_id is None:
                raise OpenAIError(400, "a tool message needs the tool_call_id it answers",
                                  param=f"messages.{i}.tool_call_id", code=400)  # fmt: skip
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise OpenAIError(400, "only assistant messages carry tool_calls", param=f"messages.{i}.tool_calls",
                                  code=400)  # fmt: skip
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls
            ]  # fmt: skip
        if m.reasoning_content is not None:
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


def render_chat_prompt(tokenizer, body: ChatPrompt, chat_template: str | None = None) -> dict[str, Any]:
    """Apply the model's chat template (or `chat_template`); the engine gets the text and its token ids."""
    if tokenizer is None or (chat_template is None and getattr(tokenizer, "chat_template", None) is None):
        raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages", code=400)
    conversation = _conversation(body)
    kwargs = body.chat_template_kwargs or {}
    forbidden = sorted(FORBIDDEN_TEMPLATE_KWARGS & kwargs.keys())
    if forbidden:
        raise OpenAIError(400, f"chat_template_kwargs may not set {forbidden}", param="chat_template_kwargs", code=400)
    if body.continue_final_message and conversation[-1]["role"] != "assistant":
        raise OpenAIError(
            400, "continue_final_message needs a final assistant message", param="continue_final_message", code=400
        )
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            **kwargs,
        )
    except Exception as e:  # jinja raises on conversations the template rejects
        raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages", code=400) from e
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
