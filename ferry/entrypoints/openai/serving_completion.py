"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ferry.engine.input_processor import check_logprobs
from ferry.entrypoints.openai.protocol import MAX_PROMPTS, CompletionRequest, OpenAIError
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
from ferry.entrypoints.openai.serving_beam_search import beam_search_completion, check_beam_search
from ferry.outputs import CompletionOutput
from ferry.sampling_params import truncated_prompt


def prompt_list(prompt: Any) -> list:
    """OpenAI's four prompt forms as a list of engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", param="prompt", code=400)
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise OpenAIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt", code=400)
    return [p if isinstance(p, str) else list(p) for p in prompt]


async def tokenize_prompts(tokenizer, prompts: list) -> list:
    """Text prompts tokenized off the event loop (long prompts take milliseconds)."""
    if tokenizer is None or all(not isinstance(p, str) for p in prompts):
        return prompts

    def run() -> list:
        return [{"prompt": p, "prompt_token_ids": tokenizer.encode(p)} if isinstance(p, str) else p for p in prompts]

    return await asyncio.to_thread(run)


def echo_logprobs(out, top: int, completion: dict[str, Any], tokenizer, as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's legacy `echo` with `logprobs`: the prompt's tokens come first in the logprobs object,
    the first with null logprobs (nothing precedes it), then the completion's (offsets from 0).
    `as_ids`: tokens named `token_id:<id>` (offsets still count their text)."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tok, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):
        if entry is None:  # the first token: its text, no logprob
            text, lp, alternatives = tokenizer.decode([tok]) if tokenizer is not None else "", None, None
        else:
            text, lp = entry[tok].decoded_token or "", finite(entry[tok].logprob)
            alternatives = {token_label(t, e.decoded_token, as_ids): finite(e.logprob) for t, e in entry.items()
                            if e.rank <= top}  # fmt: skip
        tokens.append(token_label(tok, text, as_ids))
        token_lps.append(lp)
        tops.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens + completion["tokens"],
            "token_logprobs": token_lps + completion["token_logprobs"],
            "top_logprobs": tops + completion["top_logprobs"],
            "text_offset": offsets + completion["text_offset"]}  # fmt: skip


class LogprobsBuilder:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, start_offset: int = 0, as_ids: bool = False) -> None:
        self.offset, self.as_ids = start_offset, as_ids  # as_ids: tokens named `token_id:<id>`

    def build(self, c: CompletionOutput) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, entry in zip(c.token_ids, c.logprobs or []):
            sampled = entry[tok]
            text = sampled.decoded_token or ""
            tokens.append(token_label(tok, text, self.as_ids))
            token_lps.append(finite(sampled.logprob))
            tops.append({token_label(t, e.decoded_token, self.as_ids): finite(e.logprob) for t, e in entry.items()})
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def create_completion(request: Request, state: ServerState, body: CompletionRequest):
    model = check_model(state, body.model)
    engine = ready_engine(state)
    if body.suffix:
        raise OpenAIError(400, "suffix is not supported", param="suffix", code=400)
    prompts = prompt_list(body.prompt)
    # echo with max_tokens 0 (OpenAI's and vLLM's way to score a prompt): one token is computed, as
    # the engine always samples, and left out of the answer.
    score_only = body.max_tokens == 0
    if score_only and not body.echo:
        raise OpenAIError(400, "max_tokens: Input should be greater than or equal to 1 (0 only with echo: the "
                               "prompt scored, nothing generated)", param="max_tokens", code=400)  # fmt: skip
    if body.use_beam_search:
        check_beam_search(body, engine.info.max_logprobs)
        check_priority(state, body)
        admit(state, engine, len(prompts) * body.n)  # before tokenizing, as below
        return await beam_search_completion(request, state, engine, body, model,
                                            await tokenize_prompts(engine.tokenizer, prompts))  # fmt: skip
    params = body.sampling_params(1 if score_only else body.max_tokens, body.logprobs, state.sampling_defaults)
    if body.echo and body.logprobs is not None:  # the echoed prompt's tokens carry logprobs too
        params.prompt_logprobs = max(params.prompt_logprobs or 0, body.logprobs)
    check_logprobs(params, engine.info.max_logprobs)  # before the grammar and the tokenizing
    plan = kv_transfer_plan(engine, body, len(prompts), params)
    await check_structured_output(params.structured_outputs, body.structured_output_params()[1])
    check_priority(state, body)
    admit(state, engine, len(prompts) * params.n)  # before tokenizing; add_requests checks again
    due = deadline(state)
    prompts = await tokenize_prompts(engine.tokenizer, prompts)
    base_id, reply_id = request_ids(request, "cmpl")
    streams = add_requests(state, engine, base_id, prompts, params, body, plan, body.max_tokens)
    n = params.n
    created = now_s()
    tokenizer = engine.tokenizer
    with_ids = body.return_token_ids if body.return_token_ids is not None else tokenizer is None
    as_ids = tokens_as_ids(state, body)  # logprobs name tokens `token_id:<id>`

    def echo_text(i: int) -> str:
        p = prompts[i]
        ids = p["prompt_token_ids"] if isinstance(p, dict) else p
        kept = truncated_prompt(ids, params.truncate_prompt_tokens, engine.info.max_model_len)
        if isinstance(p, dict) and len(kept) == len(ids):
            return p["prompt"]
        return tokenizer.decode(kept) if tokenizer is not None else ""  # what the model read

    # A scored prompt generates nothing the client sees (the one token computed is dropped): no output log.
    outputs = merged_outputs(engine, streams, None if score_only else output_log(state, params))
    if score_only:
        outputs = _nothing_generated(outputs)
    if body.stream:
        return StreamingResponse(
            _stream(request, engine, outputs, body, model, reply_id, created, n, echo_text, with_ids, due, as_ids),
            media_type="text/event-stream",
        )

    finals: dict[int, Any] = {}
    async for i, out in until_disconnect(request, outputs, due):
        finals[i] = out
    if len(finals) < len(streams):
        engine.forget_kv_sent(base_id)
        return None  # the client went away
    choices, completion_tokens, prompt_tokens, cached = [], 0, 0, 0
    for i in range(len(streams)):
        out = finals[i]
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        prefix = echo_text(i) if body.echo else ""
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            lp = None
            if body.logprobs is not None:
                lp = LogprobsBuilder(len(prefix), as_ids).build(c)
                if body.echo:
                    lp = echo_logprobs(out, body.logprobs, lp, tokenizer, as_ids)
            choice = {
                "index": i * n + c.index,
                "text": prefix + c.text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out)
            if with_ids:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
    choices.sort(key=lambda ch: ch["index"])
    response = {
        "id": reply_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached),
    }
    if plan.export_to is not None:
        response["kv_transfer_params"] = await kv_sent_params(engine, plan, base_id, finals[0])
    return JSONResponse(response)


def _scored(reason: str | None) -> str | None:
    """A score-only choice's finish: length where its one token stopped or ran out; an abort stays one."""
    return "length" if reason in ("stop", "length") else reason


async def _nothing_generated(outputs: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
    """The outputs with their generated token taken out (echo with max_tokens 0). Closing this
    closes `outputs` (which aborts their requests)."""
    try:
        async for i, out in outputs:
            empty = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                         cumulative_logprob=None, finish_reason=_scored(c.finish_reason),
                                         stop_reason=None) for c in out.outputs]  # fmt: skip
            yield i, dataclasses.replace(out, outputs=empty)
    finally:
        await outputs.aclose()


async def _stream(
    request, engine, outputs, body, model, reply_id, created, n, echo_text, with_ids, due, as_ids
) -> AsyncIterator[bytes]:
    lp_builders: dict[int, LogprobsBuilder] = {}
    echoed: set[int] = set()
    ids_sent: set[int] = set()
    completion_tokens = 0
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}

    tokens_of: dict[int, int] = {}  # each choice's tokens so far

    def chunk(choices: list[dict[str, Any]], usage_now: dict[str, Any] | None = None) -> bytes:
        data = {"id": reply_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if usage_now is None and body.continuous_usage:  # the choice's so far (vLLM's)
            index = choices[0]["index"]
            usage_now = usage(prompt_tokens[index // n], tokens_of[index], cached[index // n])
        if body.include_usage:  # OpenAI: every chunk has the field, null but in the last one
            data["usage"] = usage_now
        return sse(data)

    try:
        async for i, out in until_disconnect(request, outputs, due):
            prompt_tokens[i] = len(out.prompt_token_ids)
            cached[i] = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                index = i * n + c.index
                text = c.text
                if body.echo and index not in echoed:
                    echoed.add(index)
                    text = echo_text(i) + text
                completion_tokens += len(c.token_ids)
                tokens_of[index] = tokens_of.get(index, 0) + len(c.token_ids)
                lp, first = None, index not in lp_builders
                if body.logprobs is not None or body.prompt_logprobs is not None:
                    start = len(echo_text(i)) if body.echo else 0
                    builder = lp_builders.setdefault(index, LogprobsBuilder(start, as_ids))
                    lp = builder.build(c) if body.logprobs is not None else None
                    if first and body.echo and lp is not None:
                        lp = echo_logprobs(out, body.logprobs, lp, engine.tokenizer, as_ids)
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if first and body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out)
                if with_ids:  # as vLLM: the prompt's ids in a choice's first chunk, then the new ids
                    if index not in ids_sent:
                        ids_sent.add(index)
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
            for choice in choices:  # one choice a chunk, as OpenAI and vLLM send them
                yield chunk([choice])
        if body.include_usage:
            yield chunk([], usage(sum(prompt_tokens.values()), completion_tokens, sum(cached.values())))
    except Exception as e:  # headers are sent: report in-band, as vLLM does
        yield sse(as_openai_error(e).body())
    yield SSE_DONE
