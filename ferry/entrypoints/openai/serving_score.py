"""POST /score and /rerank (vLLM's, also under /v1/; /v2/rerank too, Cohere's path): how related
texts are, from the loaded model's embeddings.

ferry serves decoder models, so a score is what vLLM gives for an embedding model: the cosine
similarity of the two texts' pooled vectors (`--pooling-type`; a cross-encoder's learned score is not
this). `/score` pairs `text_1` with `text_2`: one with each of several, or pairwise when both are lists
of one length. `/rerank` scores each document against the query and returns them best first, the
`top_n` best (0: all). Every text is embedded once per request, in one batch.
"""

from __future__ import annotations

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

from ferry.entrypoints.openai.protocol import MAX_PROMPTS, OpenAIError, RerankRequest, ScoreRequest
from ferry.entrypoints.openai.serving import ServerState, check_model, now_s, random_id, ready_engine
from ferry.entrypoints.openai.serving_embedding import embed


def _check_texts(texts: list[str], field: str, state: ServerState) -> None:
    """Texts bounded as prompts are (a context's worth of characters each, at most MAX_PROMPTS)."""
    if not texts:
        raise OpenAIError(400, f"{field} must not be empty", param=field, code=400)
    if len(texts) > MAX_PROMPTS:
        raise OpenAIError(400, f"at most {MAX_PROMPTS} texts in {field}", param=field, code=400)
    limit = state.prompt_limits(ready_engine(state)).max_chars
    for t in texts:
        if not t:
            raise OpenAIError(400, f"{field} must not hold empty texts", param=field, code=400)
        if len(t) > limit:
            raise OpenAIError(400, f"a text in {field} has {len(t)} characters, more than a context can hold "
                                   f"(at most {limit})", param=field, code=400)  # fmt: skip


async def _similarities(request: Request, state: ServerState, body, firsts: list[str], seconds: list[str],
                        prefix: str) -> tuple[np.ndarray, int] | None:  # fmt: skip
    """The cosine similarity of each pair (firsts[i] or firsts[0], seconds[i]), and the tokens the
    texts took; each distinct text embedded once."""
    texts = list(dict.fromkeys([*firsts, *seconds]))
    param = "documents" if isinstance(body, RerankRequest) else "text_2"
    if len(texts) > state.max_queue_len:  # each text is a request of its own in the engine's queue
        raise OpenAIError(400, f"{len(texts)} distinct texts, more than this server queues at once "
                               f"(--max-queue-len {state.max_queue_len})", param=param, code=400)  # fmt: skip
    embedded = await embed(request, state, body, texts, normalize=True, prefix=prefix)
    if embedded is None:
        return None
    vectors, num_tokens = embedded
    at = {t: i for i, t in enumerate(texts)}
    v = np.asarray(vectors, dtype=np.float64)
    a = v[[at[firsts[i if len(firsts) > 1 else 0]] for i in range(len(seconds))]]
    b = v[[at[t] for t in seconds]]
    return np.clip((a * b).sum(axis=1), -1.0, 1.0), num_tokens


async def create_score(request: Request, state: ServerState, body: ScoreRequest):
    model = check_model(state, body.model)
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    _check_texts(firsts, "text_1", state)
    _check_texts(seconds, "text_2", state)
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise OpenAIError(400, f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: send one text_1, or as "
                               "many as text_2 (scored pairwise)", param="text_1", code=400)  # fmt: skip
    scored = await _similarities(request, state, body, firsts, seconds, "score")
    if scored is None:
        return None  # the client went away
    scores, num_tokens = scored
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return JSONResponse({"id": random_id("score"), "object": "list", "created": now_s(), "model": model, "data": data,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                                   "completion_tokens": 0}})  # fmt: skip


async def create_rerank(request: Request, state: ServerState, body: RerankRequest):
    model = check_model(state, body.model)
    _check_texts([body.query], "query", state)
    _check_texts(body.documents, "documents", state)
    scored = await _similarities(request, state, body, [body.query], body.documents, "rerank")
    if scored is None:
        return None
    scores, num_tokens = scored
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # best first; ties keep the documents' order
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": float(scores[i])}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    return JSONResponse({"id": random_id("rerank"), "model": model, "usage": {"total_tokens": num_tokens},
                         "results": results})  # fmt: skip
