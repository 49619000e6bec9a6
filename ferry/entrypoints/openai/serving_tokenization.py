"""POST /tokenize and /detokenize (vLLM's endpoints): the server's own tokenizer and chat template,
so a client counts tokens exactly as the engine will. Work is off the event loop and bounded by
the prompt limits (text as for a completion, token lists to the model's context)."""

from __future__ import annotations

import asyncio
from typing import Any

from ferry.entrypoints.openai.chat_prompt import render_chat_prompt
from ferry.entrypoints.openai.protocol import (
    DetokenizeRequest,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from ferry.entrypoints.openai.serving import ServerState, check_model, ready_engine


def _tokenizer(engine):
    if engine.tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer (--load-format dummy)", code=400)
    return engine.tokenizer


def _tokenize(tokenizer, body: TokenizeCompletionRequest | TokenizeChatRequest, chat_template: str | None) -> list[int]:
    if isinstance(body, TokenizeChatRequest):
        return render_chat_prompt(tokenizer, body, chat_template)["prompt_token_ids"]
    return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)


async def tokenize(state: ServerState, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    check_model(state, body.model)
    engine = ready_engine(state)
    tokenizer = _tokenizer(engine)
    ids = await asyncio.to_thread(_tokenize, tokenizer, body, state.chat_template)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids,
                           "token_strs": None}  # fmt: skip
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


async def detokenize(state: ServerState, body: DetokenizeRequest) -> dict[str, Any]:
    check_model(state, body.model)
    engine = ready_engine(state)
    tokenizer = _tokenizer(engine)
    limit = engine.info.max_model_len
    if len(body.tokens) > limit:
        raise OpenAIError(400, f"at most {limit} tokens (the model's context), got {len(body.tokens)}",
                          param="tokens", code=400)  # fmt: skip
    vocab = len(tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens", code=400)
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}
