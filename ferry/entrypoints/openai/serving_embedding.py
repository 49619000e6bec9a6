"""POST /v1/embeddings: each input's vector from the loaded model (PoolingParams), in the same
engine as generation; the engine core batches embedding requests that arrive close together
(`--embed-max-delay-ms`, `--embed-max-batch`)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

from ferry.entrypoints.openai.protocol import EmbeddingRequest, OpenAIError
from ferry.entrypoints.openai.serving import (
    ServerState,
    add_requests,
    admit,
    check_model,
    check_priority,
    deadline,
    merged_outputs,
    random_id,
    ready_engine,
    until_disconnect,
)
from ferry.entrypoints.openai.serving_completion import prompt_list, tokenize_prompts
from ferry.sampling_params import PoolingParams, RequestOutputKind, SamplingParams


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":  # OpenAI's: little-endian float32, base64
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def embed(request: Request, state: ServerState, body, inputs: list, normalize: bool = True,
                prefix: str = "embd") -> tuple[list[list[float]], int] | None:  # fmt: skip
    """Each input's pooled vector, and the prompt tokens they took (None: the client went away).
    `body` gives the request's priority, cache_salt, adapter (model) and truncate_prompt_tokens."""
    engine = ready_engine(state)
    params = SamplingParams(max_tokens=1, pooling=PoolingParams(normalize=normalize),
                            truncate_prompt_tokens=body.truncate_prompt_tokens,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    check_priority(state, body)
    admit(state, engine, len(inputs))
    due = deadline(state)
    prompts = await tokenize_prompts(engine.tokenizer, inputs)
    streams = add_requests(state, engine, random_id(prefix), prompts, params, body)
    results: list[Any] = [None] * len(streams)
    async for i, out in until_disconnect(request, merged_outputs(engine, streams), due):
        results[i] = out
    if any(r is None or r.embedding is None for r in results):
        return None
    return [r.embedding for r in results], sum(len(r.prompt_token_ids) for r in results)


async def create_embedding(request: Request, state: ServerState, body: EmbeddingRequest):
    model = check_model(state, body.model)
    try:
        inputs = prompt_list(body.input)
    except OpenAIError as e:
        raise OpenAIError(e.status, e.message.replace("prompt", "input"), param="input", code=400) from None
    embedded = await embed(request, state, body, inputs, body.normalize)
    if embedded is None:
        return None  # the client went away
    vectors, num_tokens = embedded
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]  # fmt: skip
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})  # fmt: skip
