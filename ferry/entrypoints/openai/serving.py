"""What the completion and chat handlers share: admission, errors, SSE, usage, stream merging."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request

from ferry.engine.async_llm import AsyncLLM, EngineStalledError, RemotePrefill, RequestStream, prompt_digest
from ferry.engine.core_client import EngineDeadError
from ferry.entrypoints.openai.http_middleware import client_request_id
from ferry.entrypoints.openai.protocol import OpenAIError, PromptLimits, wait_for_disconnect
from ferry.entrypoints.openai.request_log import OutputCollector, RequestLogger
from ferry.kv_transfer.allowed_receivers import allow_list
from ferry.outputs import RequestOutput
from ferry.sampling_params import InvalidParameterError, StructuredOutputsParams
from ferry.structured_output.grammar import check as check_grammar

_DONE = object()
logger = logging.getLogger("ferry.server")


class RequestAbortedError(RuntimeError):
    """The server aborted a request (drain timeout, shutdown)."""


class RequestTimeoutError(RuntimeError):
    """A request ran past `--request-timeout` (it is aborted)."""


@dataclass
class ServerState:
    served_model_names: list[str]
    max_queue_len: int
    allow_client_priority: bool = False  # else a request's `priority` must be 0 (the operator's)
    request_timeout: float | None = None  # seconds a request may take, queueing included
    tool_parser: str | None = None  # --tool-call-parser: reads calls out of text for tool_choice auto
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None  # --reasoning-parser: splits off reasoning_content
    # The model's sampling defaults for fields a request leaves unset (--generation-config).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    request_logger: RequestLogger | None = None  # --enable-log-requests
    chat_template: str | None = None  # --chat-template's text (None: the tokenizer's own)
    response_role: str = "assistant"  # --response-role: a chat answer's role after a generation prompt
    force_include_usage: bool = False  # --enable-force-include-usage: every stream ends with its usage
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: the requests' default
    # --lora-modules: adapter name -> its directory; a request naming one as its model runs under it.
    lora_modules: dict[str, str] = field(default_factory=dict)
    # --allow-runtime-lora-updating: the directories (resolved) adapters may be loaded from over
    # HTTP (serving_lora.py); None: off. The lock keeps one load or unload at a time.
    lora_update_dirs: list[str] | None = None
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    engine: AsyncLLM | None = None
    draining: bool = False
    startup_error: str | None = None
    _prompt_limits: PromptLimits | None = None

    def prompt_limits(self, engine: AsyncLLM) -> PromptLimits:
        """The prompt bounds of the loaded model (computed once; needs the engine ready)."""
        if self._prompt_limits is None:
            self._prompt_limits = PromptLimits.of(engine.info.max_model_len, engine.tokenizer)
        return self._prompt_limits

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def tokens_as_ids(state: ServerState, body) -> bool:
    """Whether a request's logprobs name tokens `token_id:<id>` (vLLM's return_tokens_as_token_ids)."""
    asked = getattr(body, "return_tokens_as_token_ids", None)
    return state.return_tokens_as_token_ids if asked is None else asked


def token_label(token_id: int, decoded: str | None, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or `token_id:<id>`."""
    return f"token_id:{token_id}" if as_ids else decoded or ""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(request: Request, prefix: str) -> tuple[str, str]:
    """(the engine's id, the answer's id) of a request. With an `X-Request-Id` header (vLLM's
    tracing) the answer's is `<prefix>-<that id>` and the engine's carries it too, with a random
    tail: ids the engine holds must be unique, whatever clients send."""
    client_id = client_request_id(request.headers.get("x-request-id"))
    if client_id is None:
        engine_id = random_id(prefix)
        return engine_id, engine_id
    return f"{prefix}-{client_id}-{uuid.uuid4().hex[:8]}", f"{prefix}-{client_id}"


def now_s() -> int:
    return int(time.time())


def check_model(state: ServerState, model: str | None) -> str:
    """The served name to report: the first, whichever of them was asked for (vLLM's), or the LoRA
    adapter's; 404 for a model this server does not serve."""
    if model in state.lora_modules:
        return model
    if model and model not in state.served_model_names:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")
    return state.model_name


def lora_of(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's model names, or None (the base model)."""
    return model if model in state.lora_modules else None


def ready_engine(state: ServerState) -> AsyncLLM:
    """The engine, if this server takes new requests now (503 while loading or draining)."""
    engine = state.engine
    if state.draining:
        raise OpenAIError(503, "the server is shutting down", "service_unavailable", code=503)
    if engine is None or not engine.ready:
        why = (engine and (engine.dead or engine.stalled)) or "the model is still loading"
        raise OpenAIError(503, why, "service_unavailable", code=503)
    return engine


def deadline(state: ServerState) -> float | None:
    """When a request that starts now must be done (time.monotonic()), or None."""
    return None if state.request_timeout is None else time.monotonic() + state.request_timeout


def check_priority(state: ServerState, body) -> None:
    """A client's `priority` would let it jump every other tenant's queue: the operator's to allow."""
    if body.priority != 0 and not state.allow_client_priority:
        raise OpenAIError(
            400, "this server does not take priority from clients (start it with --allow-client-priority; behind "
            "`ferry gateway`, set a priority per API key)", param="priority", code=400,
        )  # fmt: skip


def admit(state: ServerState, engine: AsyncLLM, num_seqs: int) -> None:
    """Room for `num_seqs` more sequences in the waiting queue, else 429 (400 if it could never fit)."""
    limit = state.max_queue_len
    if num_seqs > limit:
        raise OpenAIError(
            400, f"the request asks for {num_seqs} sequences (prompts x n); this server queues at most {limit}",
            param="n", code=400,
        )  # fmt: skip
    if engine.num_queued + num_seqs > limit:
        raise OpenAIError(
            429,
            f"the server's waiting queue is full ({engine.num_queued} sequences waiting, --max-queue-len "
            f"{limit}); retry later",
            "rate_limit_exceeded",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )


def as_openai_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidParameterError):
        return OpenAIError(400, str(exc), param=exc.param, code=400)
    if isinstance(exc, ValueError):
        return OpenAIError(400, str(exc), code=400)
    if isinstance(exc, (EngineDeadError, EngineStalledError, RequestAbortedError)):
        return OpenAIError(503, str(exc), "service_unavailable", code=503)
    if isinstance(exc, RequestTimeoutError):
        return OpenAIError(504, str(exc), "timeout", code=504)
    # The exception's text stays in the log: it may name paths, peers or another request's data.
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s", error_id, exc_info=exc)
    return OpenAIError(500, f"internal server error (id {error_id} in the server log)", "internal_server_error",
                       code=500)  # fmt: skip


_RECEIVER = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")


@dataclass
class KVTransferPlan:
    """What a request's `kv_transfer_params` ask of this worker (prefill/decode disaggregation)."""

    export_to: str | None = None  # prefill: send the prompt's KV here after one token ("": to Redis)
    remote: RemotePrefill | None = None  # decode: continue from the prefill worker's token

    def response_params(self, done, out: RequestOutput) -> dict[str, Any]:
        """The prefill side's answer: the token it sampled and how the transfer went."""
        return {
            "first_token_ids": list(out.outputs[0].token_ids),
            "prompt_digest": prompt_digest(out.prompt_token_ids),
            "ok": done.ok,
            "num_blocks": done.num_blocks,
            "num_bytes": done.num_bytes,
            "seconds": round(done.seconds, 6),
            "error": done.error,
        }


def kv_transfer_plan(engine: AsyncLLM, body, num_prompts: int, params) -> KVTransferPlan:
    """Validate `kv_transfer_params` (400 naming the problem); a prefill worker generates at most
    one token for any request."""
    info = engine.info
    if info.kv_role == "prefill":
        params.max_tokens = 1
    p = body.kv_transfer_params
    if not p:
        return KVTransferPlan()
    if p.get("do_remote_decode"):
        if info.kv_transfer is None:
            raise OpenAIError(400, "this worker sends no KV blocks (start it with --kv-transfer)",
                              param="kv_transfer_params", code=400)  # fmt: skip
        if body.stream or num_prompts != 1 or params.n != 1:
            raise OpenAIError(400, "a request prefilled for remote decode must be one prompt, n = 1, not streamed",
                              param="kv_transfer_params", code=400)  # fmt: skip
        target = p.get("decode_receiver")
        if info.kv_transfer != "redis":
            if not (isinstance(target, str) and _RECEIVER.fullmatch(target)):
                raise OpenAIError(400, "kv_transfer_params.decode_receiver must be the decode worker's tcp:// "
                                  "address", param="kv_transfer_params", code=400)  # fmt: skip
            if not allow_list(engine.kv_transfer.allowed_receivers).allows(target):
                raise OpenAIError(403, f"kv_transfer_params.decode_receiver {target} is not among this worker's "
                                  "--kv-transfer-allowed-receivers", param="kv_transfer_params",
                                  code=403)  # fmt: skip
        params.max_tokens = 1
        return KVTransferPlan(export_to=target if info.kv_transfer != "redis" else "")
    if p.get("do_remote_prefill"):
        ids, digest = p.get("first_token_ids"), p.get("prompt_digest")
        if not (isinstance(ids, list) and all(type(t) is int for t in ids) and isinstance(digest, str)):
            raise OpenAIError(400, "kv_transfer_params needs first_token_ids (token ids) and prompt_digest",
                              param="kv_transfer_params", code=400)  # fmt: skip
        if num_prompts != 1:
            raise OpenAIError(400, "a remotely prefilled request has one prompt", param="kv_transfer_params",
                              code=400)  # fmt: skip
        return KVTransferPlan(remote=RemotePrefill(ids, digest))
    return KVTransferPlan()


async def kv_sent_params(engine: AsyncLLM, plan: KVTransferPlan, request_id: str, out: RequestOutput):
    """Prefill side, after the request's one token: wait for its blocks to reach the decode worker."""
    timeout = 2 * engine.kv_transfer.timeout + 5.0 if engine.kv_transfer else 30.0
    done = await engine.kv_sent(request_id, timeout)
    return plan.response_params(done, out)


def salted(prompt, cache_salt: str | None):
    """An engine prompt carrying the request's cache_salt (core/block_hash.py)."""
    if cache_salt is None:
        return prompt
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": cache_salt}
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, "cache_salt": cache_salt}


async def check_structured_output(params: StructuredOutputsParams | None, field: str) -> None:
    """Validate a request's grammar (response_format, structured_outputs, a tool's schema) off the
    event loop: a large schema takes milliseconds to compile. The engine's check then finds it cached."""
    if params is not None:
        await asyncio.to_thread(check_grammar, params, field)


def add_requests(state: ServerState, engine: AsyncLLM, base_id: str, prompts: list, params, body,
                 plan: KVTransferPlan | None = None,
                 asked_max_tokens: int | None = None) -> list[RequestStream]:  # fmt: skip
    """One engine request per prompt; all or nothing. The queue limit is checked again here, with
    no await between the check and the adding: thousands of requests admitted together before
    their tokenizing cannot all pass on a queue that filled meanwhile. `asked_max_tokens`: the
    client's max_tokens; a prompt plus it over the context is a 400, as vLLM checks it, whatever
    the model's max_new_tokens lowered it to (None, no max_tokens named: max_new_tokens, if any, is
    shortened to the room left instead)."""
    admit(state, engine, len(prompts) * params.n)
    streams: list[RequestStream] = []
    plan = plan or KVTransferPlan()
    priority = body.priority
    try:
        for i, prompt in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(engine.add_request(rid, salted(prompt, body.cache_salt), params, priority=priority,
                                              kv_export_to=plan.export_to, remote_prefill=plan.remote,
                                              strict_context=asked_max_tokens is not None,
                                              asked_max_tokens=asked_max_tokens,
                                              lora_request=lora_of(state, getattr(body, "model", None))))  # fmt: skip
            if state.request_logger is not None:  # the prompt as sent, without the tenant's cache_salt
                state.request_logger.log_inputs(rid, prompt, params, streams[-1].num_prompt_tokens)
    except Exception:
        for s in streams:
            engine.abort(s.request_id)
        raise
    return streams


def output_log(state: ServerState, params) -> OutputCollector | None:
    """--enable-log-outputs' collector for one request's outputs, or None."""
    return state.request_logger.collector(params) if state.request_logger is not None else None


def merged_outputs(engine: AsyncLLM, streams: list[RequestStream],
                   log: OutputCollector | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:  # fmt: skip
    """(prompt index, output) from several requests as they come; closing it aborts the unfinished.
    `log`: --enable-log-outputs' collector, which logs each choice as it finishes."""
    outputs = _merged(engine, streams)
    return outputs if log is None else _logged(outputs, log)


async def _logged(outputs, log: OutputCollector) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        async for i, out in outputs:
            log.add(out)
            yield i, out
    finally:
        await outputs.aclose()  # now, not when collected: closing aborts the unfinished requests


async def _merged(engine: AsyncLLM, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(streams) == 1:
        async for out in engine.iterate(streams[0]):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in engine.iterate(stream):
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:  # the pumps' own cleanup may not have run yet
            if not s.finished:
                engine.abort(s.request_id)


async def until_disconnect(request: Request, agen: AsyncIterator, deadline: float | None = None) -> AsyncIterator:
    """Iterate `agen` until it ends or the client disconnects (then `agen` is closed, aborting its
    requests), even while no output is due, e.g. when the request waits in the queue. Past
    `deadline` (time.monotonic()) it raises RequestTimeoutError, also aborting."""
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(agen.__anext__())
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            done, _ = await asyncio.wait({step, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise RequestTimeoutError("the request did not finish within the server's --request-timeout")
            if step not in done:
                return  # disconnected; the finally block aborts
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        # Also reached when our caller is cancelled (Starlette cancels a response whose client
        # left) while `step` still runs `agen`: cancel it and let it unwind (its own finally
        # blocks abort the requests) before closing `agen`, which must not be running.
        watcher.cancel()
        if step is not None and not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await agen.aclose()


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finite(x: float) -> float:
    """JSON has no -inf; a token with probability 0 gets a very negative number."""
    return x if x > -9999.0 else -9999.0


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: {logprob,
    rank, decoded_token}} for its token and the top alternatives."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()}
            for entry in out.prompt_logprobs]  # fmt: skip
