"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ferry.entrypoints.openai.protocol import FORBIDDEN_TEMPLATE_KWARGS, ChatCompletionRequest, OpenAIError
from ferry.entrypoints.openai.serving import (
    SSE_DONE,
    ServerState,
    add_requests,
    admit,
    as_openai_error,
    check_model,
    check_priority,
    check_structured_output,
    deadline,
    finite,
    kv_sent_params,
    kv_transfer_plan,
    merged_outputs,
    now_s,
    random_id,
    ready_engine,
    sse,
    until_disconnect,
    usage,
)
from ferry.outputs import CompletionOutput


def render_chat_prompt(tokenizer, body: ChatCompletionRequest) -> dict[str, Any]:
    """Apply the model's chat template; the engine gets the text and its token ids."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages", code=400)
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    kwargs = body.chat_template_kwargs or {}
    forbidden = sorted(FORBIDDEN_TEMPLATE_KWARGS & kwargs.keys())
    if forbidden:
        raise OpenAIError(400, f"chat_template_kwargs may not set {forbidden}", param="chat_template_kwargs", code=400)
    if body.continue_final_message and conversation[-1]["role"] != "assistant":
        raise OpenAIError(
            400, "continue_final_message needs a final assistant message", param="continue_final_message", code=400
        )
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            **kwargs,
        )
    except Exception as e:  # jinja raises on conversations the template rejects
        raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages", code=400) from e
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _logprobs(c: CompletionOutput, top: int) -> dict[str, Any]:
    content = []
    for tok, entry in zip(c.token_ids, c.logprobs or []):
        sampled = entry[tok]
        text = sampled.decoded_token or ""
        alternatives = sorted((e for e in entry.values() if e.rank <= top), key=lambda e: e.rank)
        content.append(
            {
                "token": text,
                "logprob": finite(sampled.logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": e.decoded_token or "",
                        "logprob": finite(e.logprob),
                        "bytes": list((e.decoded_token or "").encode()),
                    }
                    for e in alternatives
                ],
            }
        )
    return {"content": content}


async def create_chat_completion(request: Request, state: ServerState, body: ChatCompletionRequest):
    model = check_model(state, body.model)
    engine = ready_engine(state)
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs", code=400)
    top = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.sampling_params(max_tokens, top if body.logprobs else None)
    plan = kv_transfer_plan(engine, body, 1, params)
    await check_structured_output(body)
    check_priority(state, body)
    admit(state, engine, params.n)  # before tokenizing; add_requests checks again
    due = deadline(state)
    # Rendering (Jinja) and tokenizing take milliseconds on long conversations: off the event loop.
    prompt = await asyncio.to_thread(render_chat_prompt, engine.tokenizer, body)
    base_id = random_id("chatcmpl")
    streams = add_requests(state, engine, base_id, [prompt], params, body, plan)
    created = now_s()
    if body.stream:
        return StreamingResponse(
            _stream(request, engine, streams, body, model, base_id, created, top, due), media_type="text/event-stream"
        )
    final = None
    async for _, out in until_disconnect(request, merged_outputs(engine, streams), due):
        final = out
    if final is None or not final.finished:
        engine.forget_kv_sent(base_id)
        return None  # the client went away
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _logprobs(c, top) if body.logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in sorted(final.outputs, key=lambda c: c.index)
    ]
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    response = {
        "id": base_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens),
    }
    if plan.export_to is not None:
        response["kv_transfer_params"] = await kv_sent_params(engine, plan, base_id, final)
    return JSONResponse(response)


async def _stream(request, engine, streams, body, model, base_id, created, top, due) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse(
            {
                "id": base_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
        )

    completion_tokens, prompt_tokens, cached = 0, 0, 0
    try:
        # The role comes first, in its own chunk per choice, as OpenAI sends it.
        yield chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(body.n)
            ]
        )
        async for _, out in until_disconnect(request, merged_outputs(engine, streams), due):
            prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
            choices = []
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choices.append(
                    {
                        "index": c.index,
                        "delta": {"content": c.text} if c.text or c.finish_reason is None else {},
                        "logprobs": _logprobs(c, top) if body.logprobs else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
            if choices:
                yield chunk(choices)
        if body.include_usage:
            yield chunk([], usage=usage(prompt_tokens, completion_tokens, cached))
    except Exception as e:  # headers are sent: report in-band, as vLLM does
        yield sse(as_openai_error(e).body())
    yield SSE_DONE
