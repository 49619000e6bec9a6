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


async def create_embedding(request: Request, state: ServerState, body: EmbeddingRequest):
    model = check_model(state, body.model)
    engine = ready_engine(state)
    try:
        inputs = prompt_list(body.input)
    except OpenAIError as e:
        raise OpenAIError(e.status, e.message.replace("prompt", "input"), param="input", code=400) from None
    params = SamplingParams(max_tokens=1, pooling=PoolingParams(normalize=body.normalize),
                            truncate_prompt_tokens=body.truncate_prompt_tokens,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    check_priority(state, body)
    admit(state, engine, len(inputs))
    due = deadline(state)
    prompts = await tokenize_prompts(engine.tokenizer, inputs)
    base_id = random_id("embd")
    streams = add_requests(state, engine, base_id, prompts, params, body)
    results: list[Any] = [None] * len(streams)
    async for i, out in until_disconnect(request, merged_outputs(engine, streams), due):
        results[i] = out
    if any(r is None or r.embedding is None for r in results):
        return None  # the client went away
    num_tokens = sum(len(r.prompt_token_ids) for r in results)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(r.embedding, body.encoding_format)}
            for i, r in enumerate(results)]  # fmt: skip
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})  # fmt: skip
