"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ferry.engine.input_processor import check_logprobs
from ferry.entrypoints.openai.assistant_message import DeltaBuilder, finish_reason, message
from ferry.entrypoints.openai.chat_prompt import render_chat_prompt
from ferry.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIError,
)
from ferry.entrypoints.openai.reasoning import END as REASONING_END
from ferry.entrypoints.openai.reasoning import reasoning_ended_in_prompt, reasoning_open_in_prompt
from ferry.entrypoints.openai.request_log import OutputCollector
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
    output_log,
    prompt_logprobs_json,
    ready_engine,
    request_ids,
    sse,
    token_label,
    tokens_as_ids,
    until_disconnect,
    usage,
)
from ferry.entrypoints.openai.serving_beam_search import check_beam_search, search
from ferry.entrypoints.openai.tool_choice import ToolPlan, tool_plan
from ferry.outputs import CompletionOutput
from ferry.tokenizer import token_bytes


def chat_logprobs(c: CompletionOutput, top: int, tokenizer, as_ids: bool = False) -> dict[str, Any]:
    """`as_ids`: tokens named `token_id:<id>` (their bytes stay the token's own)."""

    def entry_json(token_id: int, lp) -> dict[str, Any]:
        text = lp.decoded_token or ""
        # The token's own bytes: a piece of a UTF-8 character decodes to U+FFFD, whose bytes are not
        # the piece's. A token the output skips (a special one) has no text and no bytes.
        raw = token_bytes(tokenizer, token_id) if tokenizer is not None and text else None
        return {"token": token_label(token_id, text, as_ids), "logprob": finite(lp.logprob),
                "bytes": list(raw if raw is not None else text.encode())}  # fmt: skip

    content = []
    for tok, entry in zip(c.token_ids, c.logprobs or []):
        alternatives = sorted(((t, e) for t, e in entry.items() if e.rank <= top), key=lambda te: te[1].rank)
        content.append({**entry_json(tok, entry[tok]), "top_logprobs": [entry_json(t, e) for t, e in alternatives]})
    return {"content": content, "refusal": None}


def _reasoning_open(state: ServerState, engine, prompt: dict[str, Any], params) -> bool | None:
    """With a reasoning parser: whether the output starts inside the reasoning (None: no parser).
    A grammar then applies only after `</think>`, unless the prompt already closed it."""
    if state.reasoning_parser is None:
        return None
    text = prompt["prompt"]
    if params.structured_outputs is not None and not reasoning_ended_in_prompt(text):
        end = engine.tokenizer.encode(REASONING_END, add_special_tokens=False)
        params.structured_outputs = dataclasses.replace(params.structured_outputs, after_token_ids=end)
    return reasoning_open_in_prompt(text)


@dataclasses.dataclass
class ChatRun:
    """A chat request admitted and in the engine: what answering it needs (the chat endpoint's, or
    the Responses API's, serving_responses.py)."""

    engine: Any
    model: str
    base_id: str  # the engine's request id
    reply_id: str  # the answer's id
    streams: list
    tools: ToolPlan
    reasoning_open: bool | None
    top: int  # top logprobs per token
    due: float | None
    log: OutputCollector | None
    plan: Any  # the KV-transfer plan (PD disaggregation)
    created: int


async def start_chat(request: Request, state: ServerState, body: ChatCompletionRequest, id_prefix: str) -> ChatRun:
    """Check `body`, render and tokenize its prompt and add it to the engine; OpenAIError (or
    ValueError) when it cannot run."""
    model = check_model(state, body.model)
    engine = ready_engine(state)
    if body.prompt_logprobs is not None and body.stream:
        raise OpenAIError(400, "prompt_logprobs comes back in whole responses only: send stream false",
                          param="prompt_logprobs", code=400)  # fmt: skip
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs", code=400)
    top = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    tools = tool_plan(body, state.tool_parser, state.enable_auto_tool_choice)
    params = body.sampling_params(max_tokens, top if body.logprobs else None, state.sampling_defaults)
    check_logprobs(params, engine.info.max_logprobs, "top_logprobs")  # before the grammar and the template
    grammar_field = body.structured_output_params()[1]
    if tools.grammar is not None:  # tool_choice required or named: the calls follow the tools' schemas
        params.structured_outputs, grammar_field = tools.grammar, "tools"
    plan = kv_transfer_plan(engine, body, 1, params)
    await check_structured_output(params.structured_outputs, grammar_field)
    check_priority(state, body)
    admit(state, engine, params.n)  # before tokenizing; add_requests checks again
    due = deadline(state)
    # Rendering (Jinja) and tokenizing take milliseconds on long conversations: off the event loop.
    prompt = await asyncio.to_thread(render_chat_prompt, engine.tokenizer, body, state.chat_template)
    reasoning_open = _reasoning_open(state, engine, prompt, params)
    base_id, reply_id = request_ids(request, id_prefix)
    streams = add_requests(state, engine, base_id, [prompt], params, body, plan, asked_max_tokens=max_tokens)
    return ChatRun(engine, model, base_id, reply_id, streams, tools, reasoning_open, top, due,
                   output_log(state, params), plan, now_s())  # fmt: skip


async def final_output(request: Request, run: ChatRun):
    """The request's finished output (non-streamed); None when the client went away first."""
    final = None
    async for _, out in until_disconnect(request, merged_outputs(run.engine, run.streams, run.log), run.due):
        final = out
    if final is None or not final.finished:
        run.engine.forget_kv_sent(run.base_id)
        return None
    return final


def answer_role(state: ServerState, body: ChatCompletionRequest) -> str:
    """The role a chat answer carries (vLLM's): --response-role after a generation prompt, else the
    role of the message the output continues."""
    return state.response_role if body.add_generation_prompt else body.messages[-1].role


async def _beam_search_chat(request: Request, state: ServerState, body: ChatCompletionRequest):
    """vLLM's use_beam_search on a chat: the n best beams of the rendered conversation as choices."""
    model = check_model(state, body.model)
    engine = ready_engine(state)
    check_beam_search(body, engine.info.max_logprobs)
    check_priority(state, body)
    admit(state, engine, body.n)
    prompt = await asyncio.to_thread(render_chat_prompt, engine.tokenizer, body, state.chat_template)
    ids = prompt["prompt_token_ids"]
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    base_id, reply_id = request_ids(request, "chatcmpl")
    found = await search(request, state, engine, body, [ids], max_tokens, base_id)
    if found is None:
        return None  # the client went away
    tools = tool_plan(body, state.tool_parser, state.enable_auto_tool_choice)  # (none: tools are refused)
    reasoning_open = reasoning_open_in_prompt(prompt["prompt"]) if state.reasoning_parser else None
    choices, completion_tokens = [], 0
    for j, beam in enumerate(found[0]):
        generated = beam.tokens[len(ids) :]
        completion_tokens += len(generated)
        msg, called = message(engine.tokenizer.decode(generated, skip_special_tokens=True), tools, reasoning_open)
        msg["role"] = answer_role(state, body)
        choices.append({"index": j, "message": msg, "logprobs": None,
                        "finish_reason": finish_reason(beam.finish_reason, called), "stop_reason": None})  # fmt: skip
    return JSONResponse({"id": reply_id, "object": "chat.completion", "created": now_s(), "model": model,
                         "choices": choices, "usage": usage(len(ids), completion_tokens, 0)})  # fmt: skip


async def create_chat_completion(request: Request, state: ServerState, body: ChatCompletionRequest):
    if body.use_beam_search:
        return await _beam_search_chat(request, state, body)
    run = await start_chat(request, state, body, "chatcmpl")
    role, as_ids = answer_role(state, body), tokens_as_ids(state, body)
    engine, model, tools, reasoning_open, top = run.engine, run.model, run.tools, run.reasoning_open, run.top
    if body.stream:
        builders = [DeltaBuilder(tools, reasoning_open) for _ in range(body.n)]
        return StreamingResponse(_stream(request, engine, run.streams, body, model, run.reply_id, run.created, top,
                                         run.due, builders, run.log, role, as_ids),
                                 media_type="text/event-stream")  # fmt: skip
    final = await final_output(request, run)
    if final is None:
        return None  # the client went away
    choices = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        msg, called = message(c.text, tools, reasoning_open)
        msg["role"] = role
        choices.append({
            "index": c.index,
            "message": msg,
            "logprobs": chat_logprobs(c, top, engine.tokenizer, as_ids) if body.logprobs else None,
            "finish_reason": finish_reason(c.finish_reason, called),
            "stop_reason": c.stop_reason,
        })  # fmt: skip
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    response = {
        "id": run.reply_id,
        "object": "chat.completion",
        "created": run.created,
        "model": model,
        "choices": choices,
        "usage": usage(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens),
    }
    if body.prompt_logprobs is not None:  # vLLM's place for it in a chat response
        response["prompt_logprobs"] = prompt_logprobs_json(final)
    if run.plan.export_to is not None:
        response["kv_transfer_params"] = await kv_sent_params(engine, run.plan, run.base_id, final)
    return JSONResponse(response)


async def _stream(request, engine, streams, body, model, reply_id, created, top, due,
                  builders: list[DeltaBuilder], log: OutputCollector | None,
                  role: str, as_ids: bool) -> AsyncIterator[bytes]:  # fmt: skip
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        if body.continuous_usage and "usage" not in extra:  # the choice's so far (vLLM's)
            extra["usage"] = usage(streams[0].num_prompt_tokens, tokens_of[choices[0]["index"]], cached)
        if body.include_usage:  # OpenAI: every chunk has the field, null but in the last one
            extra.setdefault("usage", None)
        return sse(
            {
                "id": reply_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
        )

    completion_tokens, prompt_tokens, cached = 0, 0, 0
    tokens_of = [0] * body.n  # each choice's tokens so far
    try:
        # The role comes first, in its own chunk per choice, as OpenAI sends it. Every chunk holds one
        # choice, as OpenAI's and vLLM's do (a client may read only choices[0] and its index).
        for i in range(body.n):
            yield chunk([{"index": i, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}])
        async for _, out in until_disconnect(request, merged_outputs(engine, streams, log), due):
            prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
            choices = []
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                tokens_of[c.index] += len(c.token_ids)
                builder = builders[c.index]
                delta = builder.delta(c.text, final=c.finish_reason is not None)
                if not delta and c.finish_reason is None and not body.logprobs:
                    continue  # text held back (a tag may be starting): nothing to say yet
                choices.append(
                    {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": chat_logprobs(c, top, engine.tokenizer, as_ids) if body.logprobs else None,
                        "finish_reason": finish_reason(c.finish_reason, builder.called),
                        "stop_reason": c.stop_reason,
                    }
                )
            for choice in choices:
                yield chunk([choice])
        if body.include_usage:
            yield chunk([], usage=usage(prompt_tokens, completion_tokens, cached))
    except Exception as e:  # headers are sent: report in-band, as vLLM does
        yield sse(as_openai_error(e).body())
    yield SSE_DONE
