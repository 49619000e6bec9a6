"""What the gateway itself says to a client: OpenAI-style error bodies and the `x-ferry-*` headers.

Everything else a client receives is a worker's response passed through byte
for byte; these are the gateway's own words, shared by admission (401, 400,
404, 413, 429, result-cache hits), the proxy (503 when no worker could take a
request) and the pass-through (which worker answered).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

WORKER_HEADER = "x-ferry-worker"
PREFILL_HEADER = "x-ferry-prefill-worker"  # disaggregated: the worker that prefilled
CACHE_HEADER = "x-ferry-cache"  # response: hit | miss; request: skip


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None, code: str | int | None = None) -> JSONResponse:  # fmt: skip
    body = {"error": {"message": message, "type": type_, "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status, headers=headers)
