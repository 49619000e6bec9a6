"""AsyncLLM: the API process's handle on an EngineCore running in its own process.

It owns the front half of the engine: validation and tokenization
(`InputProcessor`), incremental detokenization and stop strings
(`OutputProcessor`), one asyncio queue per request, and the request-level
metrics. The model and the scheduler live in the core process
(`core_proc.py`); the two talk over ZMQ with msgspec messages.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ferry.config import EngineArgs, KVEventsConfig, KVTransferConfig
from ferry.engine.core_client import EngineCoreClient, EngineDeadError, SpawnedCore
from ferry.engine.input_processor import InputProcessor, PromptType
from ferry.engine.messages import (
    UTILITY_ERRORS,
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreOutputs,
    EngineCoreOutput,
    EngineInfo,
    EngineStats,
    LoRANotLoadedError,
    UtilityCall,
    UtilityResult,
)
from ferry.engine.output_processor import OutputProcessor
from ferry.kv_transfer.outcome import KVTransferDone
from ferry.lora_request import LoRARequest, lora_name_of
from ferry.outputs import RequestOutput
from ferry.sampling_params import InvalidParameterError, SamplingParams
from ferry.utils.process import process_age

logger = logging.getLogger(__name__)


@dataclass
class RequestTally:
    """What a request's sequences add up to once the last one finishes: the most tokens any generated
    (vLLM's request_max_num_generation_tokens)."""

    unfinished: int
    max_tokens_generated: int = 0


@dataclass
class SeqTiming:
    """One sequence's timestamps (time.monotonic) and counts, for the per-request metrics."""

    arrival: float
    num_prompt_tokens: int = 0  # counted once a request's first sequence is prefilled (a token or an embedding)
    prompt_counted: bool = False
    n: int = 1  # the request's sequences
    max_tokens: int | None = None
    queue_time: float | None = None  # arrival to first scheduling (the core's)
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0  # generated
    tally: RequestTally | None = None  # shared by the request's sequences


@dataclass
class RequestStream:
    request_id: str
    num_prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False


class EngineStalledError(RuntimeError):
    """The EngineCore process is alive but has not stepped for longer than the stall timeout."""


class MetricsSink:
    """What AsyncLLM reports to; the server's Prometheus metrics implement it."""

    def on_stats(self, stats: EngineStats) -> None: ...
    def on_first_token(self, ttft: float, queue_time: float | None) -> None: ...
    def on_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None: ...
    def on_prompt(self, num_tokens: int) -> None: ...
    def on_finished(self, reason: str, e2e: float, seq: SeqTiming | None = None) -> None: ...
    def on_kv_transfer(self, done: KVTransferDone) -> None: ...
    def on_remote_prefill(self, continued: bool) -> None: ...


@dataclass
class RemotePrefill:
    """Decode side of a disaggregated request: what the prefill worker sampled for this prompt."""

    first_token_ids: list[int]
    prompt_digest: str  # of the prompt's token ids as the prefill worker saw them (prompt_digest())


def prompt_digest(token_ids: list[int]) -> str:
    """A short digest of a prompt's token ids: the decode worker checks it names the prompt it has."""
    return hashlib.sha256(msgspec.msgpack.encode(token_ids)).hexdigest()[:32]


class AsyncLLM:
    def __init__(
        self,
        args: EngineArgs,
        tokenizer=None,
        metrics: MetricsSink | None = None,
        kv_events: KVEventsConfig | None = None,
        kv_transfer: KVTransferConfig | None = None,
        stall_timeout: float | None = None,
        spawned: SpawnedCore | None = None,
    ) -> None:
        self.args = args
        # A core that sends nothing (no step's outputs, no idle heartbeat) for this long is stalled:
        # alive, but stepping no more. Its requests fail, `ready` turns False until it speaks again.
        self.stall_timeout = stall_timeout
        self.stalled: str | None = None
        self._last_heard = time.monotonic()
        self.kv_events = kv_events  # publish KV events from the core (for the gateway)
        self.kv_transfer = kv_transfer  # prefill/decode disaggregation (ferry/kv_transfer/)
        self.client = EngineCoreClient(args, kv_events, kv_transfer, spawned)  # spawned: the core started already
        self._kv_sent: dict[str, asyncio.Future] = {}  # request id -> its KVTransferDone (prefill side)
        self.tokenizer = tokenizer
        self.metrics = metrics or MetricsSink()
        self.info: EngineInfo | None = None
        self.input_processor: InputProcessor | None = None
        self.output_processor = OutputProcessor(tokenizer)
        self.streams: dict[str, RequestStream] = {}
        self.timings: dict[str, SeqTiming] = {}  # core (sequence) id -> timing
        self.unstarted: set[str] = set()  # sequence ids without a first token yet
        self.stats: EngineStats | None = None
        self.dead: str | None = None  # why the core is gone
        self.on_dead: Callable[[str], None] | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop_task: asyncio.Task | None = None

    # -- lifecycle --------------------------------------------------------

    async def start(self, timeout: float = 600.0, tokenizer_loader: Callable[[], Any] | None = None) -> None:
        """Spawn the core process and wait until it has loaded and warmed the model.

        `tokenizer_loader` runs in a thread meanwhile (the first GGUF conversion takes seconds).
        """
        self.client.spawn()  # unless it was spawned already (`ferry serve` does it first thing)
        api_start = self.client.spawned_at  # the interpreter's start, the imports, the arguments: until the spawn
        tokenizer_seconds: list[float] = []

        def load_tokenizer():
            t0 = time.perf_counter()
            try:
                return tokenizer_loader()
            finally:
                tokenizer_seconds.append(time.perf_counter() - t0)

        tokenizer_task = asyncio.ensure_future(asyncio.to_thread(load_tokenizer)) if tokenizer_loader else None
        try:
            info = await self.client.wait_ready(timeout)
        except EngineDeadError as e:
            self._mark_dead(str(e))
            raise
        if tokenizer_task is not None:
            self.tokenizer = await tokenizer_task
            self.output_processor.tokenizer = self.tokenizer
        startup = info.startup_seconds
        if tokenizer_seconds:
            startup["tokenizer"] = tokenizer_seconds[0]  # beside the core's start, in a thread
        if api_start is not None:
            startup["api_process_start"] = api_start
            startup["total"] = process_age() or 0.0
        self.info = info
        self.input_processor = InputProcessor(self.tokenizer, self.info)
        # Heard from just now: loading took as long as it took (a first start compiles kernels for
        # minutes), which is no stall; counted from construction, the first quiet half second after
        # a start slower than --engine-stall-timeout failed requests with 503.
        self._last_heard = time.monotonic()
        self._loop_task = asyncio.create_task(self._output_loop(), name="ferry-output-loop")

    async def shutdown(self, timeout: float = 5.0) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        await self.client.shutdown(timeout)

    @property
    def ready(self) -> bool:
        return self.info is not None and self.dead is None and self.stalled is None

    # -- requests ---------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        strict_context: bool = True,
        asked_max_tokens: int | None = None,
        kv_export_to: str | None = None,
        remote_prefill: RemotePrefill | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> RequestStream:
        """Validate (raises InvalidParameterError, changing nothing) and send to the core.
        `strict_context`, `asked_max_tokens`: InputProcessor.process's.

        `kv_export_to` (prefill side): once the request finishes, send its prompt's KV blocks to
        this receiver address ("" for Redis); await `kv_sent(request_id)` for the outcome.
        `remote_prefill` (decode side): continue from the token the prefill worker sampled; it is
        ignored (the first token computed here) unless the digest names this prompt and the
        request is one sequence without logprobs. `lora_request`: the LoRA adapter it runs under, one
        the core loaded (--lora-modules)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.input_processor is None:
            raise EngineDeadError("the engine is still starting")
        if self.stalled is not None:
            raise EngineStalledError(self.stalled)
        arrival = time.monotonic()
        in_use = self.streams.keys() | self.output_processor.seq_to_request.keys()
        req = self.input_processor.process(
            request_id, prompt, params, priority=priority, arrival_time=arrival, in_use=in_use,
            strict_context=strict_context, asked_max_tokens=asked_max_tokens, lora_name=lora_name_of(lora_request),
        )  # fmt: skip
        if kv_export_to is not None:
            if len(req.core_requests) != 1:
                raise InvalidParameterError("n", "a request prefilled for remote decode must have n = 1")
            req.core_requests[0].kv_export = True
            req.core_requests[0].kv_target = kv_export_to or None
        continued = remote_prefill is not None and self._takes_prefill(req, remote_prefill)
        if continued:
            req.core_requests[0].prefilled_token_ids = list(remote_prefill.first_token_ids)
        message = self.client.encode(AddRequest(req.core_requests))  # before any state changes
        self.output_processor.add_request(request_id, req.prompt, req.prompt_token_ids, req.params, req.seq_ids)
        stream = RequestStream(request_id, len(req.prompt_token_ids))
        self.streams[request_id] = stream
        tally = RequestTally(len(req.seq_ids))
        for i, sid in enumerate(req.seq_ids):
            # The prompt counts once, when it has been prefilled: a request aborted in the queue was not.
            self.timings[sid] = SeqTiming(arrival, num_prompt_tokens=len(req.prompt_token_ids) if i == 0 else 0,
                                          n=len(req.seq_ids), max_tokens=req.params.max_tokens,
                                          tally=tally)  # fmt: skip
            self.unstarted.add(sid)
        if kv_export_to is not None:
            self._kv_sent[request_id] = asyncio.get_running_loop().create_future()
        try:
            self.client.send_bytes(message)
        except EngineDeadError:
            self._forget(request_id)
            self._kv_sent.pop(request_id, None)
            raise
        if remote_prefill is not None:
            self.metrics.on_remote_prefill(continued)
        return stream

    def _takes_prefill(self, req, remote: RemotePrefill) -> bool:
        vocab = self.info.vocab_size
        return (
            len(req.core_requests) == 1
            and req.params.logprobs is None
            and req.params.prompt_logprobs is None  # computed here, over the whole prompt
            and 0 < len(remote.first_token_ids) <= 1
            and all(type(t) is int and 0 <= t < vocab for t in remote.first_token_ids)
            and remote.prompt_digest == prompt_digest(req.prompt_token_ids)
        )

    def forget_kv_sent(self, request_id: str) -> None:
        """The client left before asking for the outcome: nobody will."""
        self._kv_sent.pop(request_id, None)

    async def kv_sent(self, request_id: str, timeout: float) -> KVTransferDone:
        """The outcome of a request's KV send (prefill side), once its core has it."""
        fut = self._kv_sent.get(request_id)
        if fut is None:
            raise KeyError(request_id)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return KVTransferDone(request_id, "sent", False, error=f"no transfer result within {timeout:.0f}s")
        finally:
            self._kv_sent.pop(request_id, None)

    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams, **options
    ) -> AsyncIterator[RequestOutput]:
        """add_request(..., **options) + iterate; aborts the request if the consumer stops early
        (disconnect)."""
        stream = self.add_request(request_id, prompt, params, **options)
        async for out in self.iterate(stream):
            yield out

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        seq_ids = self._forget(request_id, count_abort=True)
        if seq_ids and self.dead is None:
            try:
                self.client.send(AbortRequests(seq_ids))
            except EngineDeadError:
                pass  # nothing left to abort

    def _forget(self, request_id: str, count_abort: bool = False) -> list[str]:
        """Drop the API-side state of a request; returns its sequence ids."""
        self._kv_sent.pop(request_id, None)
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return []
        stream.finished = True
        seq_ids = self.output_processor.seq_ids(request_id)
        self.output_processor.abort_request(request_id)
        now = time.monotonic()
        for sid in seq_ids:
            timing = self.timings.pop(sid, None)
            self.unstarted.discard(sid)
            if timing is not None and count_abort:
                self.metrics.on_finished("abort", now - timing.arrival, timing)
        return seq_ids

    @property
    def num_in_flight(self) -> int:
        """User requests with an open stream (n > 1 counts once)."""
        return len(self.streams)

    @property
    def num_queued(self) -> int:
        """Sequences sent to the core that have not produced a token yet (waiting or prefilling)."""
        return len(self.unstarted)

    async def call(self, method: str, *args: str, timeout: float = 5.0) -> EngineStats | str | None:
        """A utility call into the core loop (answered between steps)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self.client.send(UtilityCall(call_id, method, list(args)))
            result: UtilityResult = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if not result.ok:
            refusal = UTILITY_ERRORS.get(result.error_kind or "")
            raise refusal(result.error_param, result.error) if refusal else RuntimeError(result.error)
        return result.value

    async def add_lora(self, name: str, path: str, replace: bool = False) -> bool:
        """Load the PEFT adapter in `path` as `name` in the core (EngineCore.add_lora), between
        steps; whether it loaded it now (False: loaded from there already). `replace`: over the
        adapter of that name. InvalidParameterError naming why not."""
        try:
            digest = await self.call("add_lora", name, path, *(["replace"] if replace else []), timeout=120.0)
        except EngineDeadError:
            raise
        except RuntimeError as e:  # malformed args, or an unknown method: the core's refusal all the same
            raise InvalidParameterError("lora_path", str(e)) from None
        loaded_now = replace or name not in self.info.lora_digests
        self.info.lora_digests[name] = digest
        return loaded_now

    async def remove_lora(self, name: str) -> None:
        """Unload adapter `name` in the core (EngineCore.remove_lora); InvalidParameterError while
        requests still run under it. One the core no longer holds counts as unloaded."""
        try:
            await self.call("remove_lora", name, timeout=120.0)
        except LoRANotLoadedError:
            pass
        except EngineDeadError:
            raise
        except RuntimeError as e:
            raise InvalidParameterError("lora_name", str(e)) from None
        self.info.lora_digests.pop(name, None)

    # -- the output loop ------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while self.dead is None:
                msg = await self.client.recv(500)
                now = time.monotonic()
                if msg is None:
                    if not self.client.alive:
                        self._mark_dead(f"EngineCore exited unexpectedly with code {self.client.exitcode}")
                    elif self.stall_timeout is not None and now - self._last_heard > self.stall_timeout:
                        self._mark_stalled(now - self._last_heard)
                    continue
                self._last_heard = now
                if self.stalled is not None:
                    logger.warning("EngineCore answers again after a stall; ready")
                    self.stalled = None
                if isinstance(msg, CoreOutputs):
                    self.stats = msg.stats
                    self.metrics.on_stats(msg.stats)
                    if msg.outputs:
                        self._process_outputs(msg.outputs)
                elif isinstance(msg, KVTransferDone):
                    self.metrics.on_kv_transfer(msg)
                    fut = self._kv_sent.get(msg.request_id) if msg.direction == "sent" else None
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, UtilityResult):
                    fut = self._calls.get(msg.call_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, CoreFailed):
                    self._mark_dead(f"EngineCore failed: {msg.message}")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests hanging forever
            logger.exception("output loop crashed")
            self._mark_dead(f"output loop crashed: {e}")

    def _process_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.monotonic()
        for co in outputs:
            timing = self.timings.get(co.request_id)
            if timing is None:
                continue
            if (co.new_token_ids or co.embedding is not None) and not timing.prompt_counted:
                timing.prompt_counted = True  # prefilled: its first token, or an embedding's vector
                if timing.num_prompt_tokens:
                    self.metrics.on_prompt(timing.num_prompt_tokens)
            if not co.new_token_ids:
                continue
            if timing.first_token is None:
                timing.first_token, timing.queue_time = now, co.queue_time
                self.unstarted.discard(co.request_id)
                self.metrics.on_first_token(now - timing.arrival, co.queue_time)
                self.metrics.on_tokens(len(co.new_token_ids), None)
            else:
                self.metrics.on_tokens(len(co.new_token_ids), now - timing.last_token)
            timing.last_token = now
            timing.num_tokens += len(co.new_token_ids)
        request_outputs, to_abort = self.output_processor.process(outputs)
        if to_abort:  # stop strings matched: the core must stop these sequences
            self.client.send(AbortRequests(to_abort))
        finished = {co.request_id: co.finish_reason for co in outputs if co.finish_reason is not None}
        finished.update({sid: "stop" for sid in to_abort})
        for sid, reason in finished.items():
            timing = self.timings.pop(sid, None)
            self.unstarted.discard(sid)
            if timing is not None:
                self.metrics.on_finished(reason, now - timing.arrival, timing)
        for out in request_outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream.finished = True
                del self.streams[out.request_id]
            stream.queue.put_nowait(out)

    def _mark_stalled(self, silent_for: float) -> None:
        """Fail what is in flight (a 503 now beats a hang) and abort it in the core, which reads
        the aborts if it ever steps again. Readiness stays off until it does."""
        if self.stalled is None:
            self.stalled = f"EngineCore has not stepped for {silent_for:.0f} s (--engine-stall-timeout)"
            logger.error("%s; failing %d requests", self.stalled, len(self.streams))
        err = EngineStalledError(self.stalled)
        for request_id, stream in list(self.streams.items()):
            self.abort(request_id)
            stream.queue.put_nowait(err)

    def _mark_dead(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        logger.error("%s", why)
        err = EngineDeadError(why)
        for stream in self.streams.values():
            stream.finished = True
            stream.queue.put_nowait(err)
        self.streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        for fut in self._kv_sent.values():  # awaited through kv_sent's shield, if at all
            if not fut.done():
                fut.set_exception(err)
                fut.exception()  # retrieved: no "never retrieved" warning for abandoned ones
        if self.on_dead is not None:
            self.on_dead(why)
