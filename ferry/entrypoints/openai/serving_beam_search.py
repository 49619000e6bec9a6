"""`use_beam_search` on /v1/completions and /v1/chat/completions (vLLM's extra): the `n` best beams
of each prompt (ferry/entrypoints/beam_search.py), one round of requests through the engine per token, as
`LLM.beam_search` (a chat's beams become its choices' messages, serving_chat.py).

Each round's beams go in as prompts of their own (under the request's priority, cache salt and
adapter), so the prefix cache carries what they share from round to round; a client that leaves
aborts the round in flight. The answer comes whole: no streaming; and the fields a search would not
honour (logprobs, echo, grammars, stop conditions, biases, penalties) are 400s naming the field. The
temperature and the sampling fields change nothing (the likeliest tokens are taken, as in vLLM). Each
round asks for 2n logprobs, so n is held to half of --max-logprobs.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from ferry.engine.async_llm import AsyncLLM
from ferry.engine.input_processor import context_length_message
from ferry.entrypoints.beam_search import BeamSearch, BeamSearches, BeamSearchParams, BeamSearchSequence
from ferry.entrypoints.openai.protocol import CompletionRequest, OpenAIError
from ferry.entrypoints.openai.serving import (
    ServerState,
    add_requests,
    deadline,
    merged_outputs,
    now_s,
    request_ids,
    until_disconnect,
    usage,
)

# What a beam search would not honour (it takes the most likely tokens, unprocessed): refused, not dropped.
_REFUSED = ("stream", "echo", "logprobs", "prompt_logprobs", "structured_outputs", "response_format",
            "kv_transfer_params", "suffix", "stop", "stop_token_ids", "min_tokens", "logit_bias",
            "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "presence_penalty", "frequency_penalty",
            "repetition_penalty")  # fmt: skip
_REFUSED_IN_CHAT = ("top_logprobs", "tools", "tool_choice")  # (a chat's text is its message: no tool calls)


def check_beam_search(body, max_logprobs: int) -> None:
    """A completion or chat body that asks use_beam_search: 400 naming a field the search would not honour."""
    fields = type(body).model_fields
    for name in _REFUSED + _REFUSED_IN_CHAT:
        if name in fields and getattr(body, name) != fields[name].default:
            raise OpenAIError(400, f"{name} is not supported with use_beam_search", param=name, code=400)
    if 2 * body.n > max_logprobs:  # each round asks for the 2n likeliest next tokens
        raise OpenAIError(400, f"use_beam_search with n = {body.n} asks {2 * body.n} logprobs a round, more than "
                               f"--max-logprobs ({max_logprobs}) allows", param="n", code=400)  # fmt: skip


async def search(request: Request, state: ServerState, engine: AsyncLLM, body, ids: list[list[int]],
                 max_tokens: int | None, base_id: str) -> list[list[BeamSearchSequence]] | None:  # fmt: skip
    """Each prompt's `body.n` best beams, best first, searched round by round through the engine
    under the request's priority, salt and adapter; None if the client left (the round in flight
    aborted)."""
    max_len = engine.info.max_model_len
    for p in ids:
        if len(p) >= max_len or (max_tokens is not None and len(p) + max_tokens > max_len):
            raise OpenAIError(400, context_length_message(max_len, len(p), max_tokens or 1), param="max_tokens",
                              code=400)  # fmt: skip
    params = BeamSearchParams(body.n, max_tokens if max_tokens is not None else max_len,
                              ignore_eos=body.ignore_eos, length_penalty=body.length_penalty)  # fmt: skip
    searches = BeamSearches([BeamSearch(p, params, set(engine.info.eos_token_ids), max_len) for p in ids])
    step = params.step_params()
    due = deadline(state)
    while batch := searches.next_round():
        sequences = [{"prompt_token_ids": tokens} for _, tokens in batch]
        streams = add_requests(state, engine, f"{base_id}-r{searches.rounds}", sequences, step, body)
        finals: dict[int, object] = {}
        async for i, out in until_disconnect(request, merged_outputs(engine, streams), due):
            finals[i] = out
        if len(finals) < len(batch):
            return None  # the client went away (the round's requests are aborted)
        try:
            searches.advance(finals[i] for i in range(len(batch)))
        except RuntimeError as e:
            raise OpenAIError(503, str(e), "service_unavailable", code=503) from None
    return searches.best()


async def beam_search_completion(request: Request, state: ServerState, engine: AsyncLLM, body: CompletionRequest,
                                 model: str, prompts: list) -> JSONResponse | None:  # fmt: skip
    """The completion of `prompts` (tokenized) by beam search, `body.n` beams each; None if the
    client left."""
    if any(isinstance(p, str) for p in prompts):  # (tokenize_prompts leaves text as it is without a tokenizer)
        raise OpenAIError(400, "this model has no tokenizer: send token ids", param="prompt", code=400)
    ids = [p["prompt_token_ids"] if isinstance(p, dict) else p for p in prompts]
    base_id, reply_id = request_ids(request, "cmpl")
    found = await search(request, state, engine, body, ids, body.max_tokens, base_id)
    if found is None:
        return None
    tokenizer = engine.tokenizer
    with_ids = body.return_token_ids if body.return_token_ids is not None else tokenizer is None
    choices, completion_tokens = [], 0
    for i, (beams, p) in enumerate(zip(found, ids)):
        for j, beam in enumerate(beams):
            generated = beam.tokens[len(p) :]
            completion_tokens += len(generated)
            text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
            choice = {"index": i * body.n + j, "text": text, "logprobs": None, "finish_reason": beam.finish_reason,
                      "stop_reason": None}  # fmt: skip
            if with_ids:
                choice["prompt_token_ids"], choice["token_ids"] = list(p), generated
            choices.append(choice)
    return JSONResponse({"id": reply_id, "object": "text_completion", "created": now_s(), "model": model,
                         "choices": choices, "usage": usage(sum(map(len, ids)), completion_tokens, 0)})  # fmt: skip
