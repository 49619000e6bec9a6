"""EngineCore: the busy loop's body: schedule → execute → update.

It knows tokens only: it appends sampled tokens, applies the token-level
stop conditions (EOS, stop_token_ids, max_tokens, max_model_len) and frees
finished requests' blocks. With speculative decoding a step may keep several
tokens of a request (checked one by one: nothing after a stop is kept), rolls
back the rejected drafts' slots, and asks for the next step's drafts.
Text-level work (detokenization, stop strings, n > 1 aggregation) is the
OutputProcessor's, which may run in another process and aborts a request
here when one of its stop strings matches.

Under pipeline parallelism a step is a micro-batch: up to one per stage is in
flight at once (each stage works on a different one), every request in at most
one of them; a step schedules a new micro-batch while others are under way and
applies the oldest one's tokens (vLLM's batch queue).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.request import Request, RequestStatus
from ferry.core.scheduler import Scheduler
from ferry.engine.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    LoRAInUseError,
    LoRANotLoadedError,
)
from ferry.models.lora_adapters import read_peft_adapter
from ferry.sampling_params import InvalidParameterError, resolve_stop_token_ids
from ferry.structured_output.compiler import GrammarCompiler, GrammarState
from ferry.utils.math import cdiv
from ferry.worker.model_runner import ModelRunner, SubmittedStep
from ferry.worker.spec_decode import DraftProposer
from ferry.worker.step_plan import StepRecord, tree_depths
from ferry.worker.tp_worker import TensorParallelWorkers

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        eos_token_ids: set[int],
        *,
        info: EngineInfo | None = None,
        tokenizer: Any = None,
        load_tokenizer: Callable[[], Any] | None = None,
        tp_workers: TensorParallelWorkers | None = None,
        proposer: DraftProposer | None = None,
        embed_max_batch: int = 32,
        embed_max_delay: float = 0.0,
        lora_limits: tuple[int, int] | None = None,
    ) -> None:
        """Usually made by `engine/builder.py: build_engine_core`. `info` is what the API side
        needs to know of this engine; `tokenizer` is the one loaded with the model (None without
        one, or not loaded: then `load_tokenizer`, if given, loads it when a structured-output request
        first needs it); `tp_workers` are the other tensor-parallel ranks, stopped by `shutdown`;
        `proposer` drafts tokens for speculative decoding (None: off); `lora_limits`, (the largest
        rank, the most adapters loaded at once) for LoRA adapters loaded at run time (None: off)."""
        self.scheduler = scheduler
        self.runner = runner
        self.kv: KVCacheManager = scheduler.kv
        self.eos_token_ids = eos_token_ids
        self.info = info
        self.tokenizer = tokenizer
        self.tp_workers = tp_workers
        self.proposer = proposer
        self.lora_limits = lora_limits
        self.spec_num_drafts = 0
        self.step_tokens = 0  # the tokens of the step the last step() applied (0: none)
        self.spec_num_draft_tokens = 0
        self.spec_accepted_per_pos = [0] * (proposer.config.num_speculative_tokens if proposer else 0)
        # When a list, every step appends its StepRecord (the `--profile` breakdown).
        self.step_records: list[StepRecord] | None = None
        # Outputs due without a model step: tokens a prefill worker sampled (disaggregation).
        self._pending: list[EngineCoreOutput] = []
        # Structured output: grammars compile in a thread; a request waits here (out of the
        # scheduler, holding no blocks) until its grammar is ready, with the tokens a prefill
        # worker sampled for it.
        vocab_size = info.vocab_size if info is not None else runner.sampler.vocab_size
        if tokenizer is not None:
            load_tokenizer = lambda: tokenizer  # noqa: E731
        self.grammars = GrammarCompiler(load_tokenizer, vocab_size, eos_token_ids) if load_tokenizer else None
        self._awaiting_grammar: dict[str, tuple[Request, list[int], concurrent.futures.Future]] = {}
        # Dynamic batching of embedding requests: each waits here up to `embed_max_delay` seconds
        # for others, so they run as one batch, until `embed_max_batch` of them wait.
        self.embed_max_batch = embed_max_batch
        self.embed_max_delay = embed_max_delay
        self._embed_held: list[Request] = []
        # Pipeline parallelism: micro-batches in flight (at most `micro_batches`, one per stage by
        # default; 1 makes the stages take turns), oldest first, and the most seen at once.
        self.pipelined = runner.pp.size > 1
        self.micro_batches = runner.pp.size
        self._in_flight: deque[SubmittedStep] = deque()
        self.max_in_flight = 0

    def shutdown(self) -> None:
        """Collect the steps still in flight, stop the tensor/pipeline-parallel workers (if any) and the
        grammar compiler."""
        if self.grammars is not None:
            self.grammars.shutdown()
        while self._in_flight and self.tp_workers is not None:
            try:
                self.runner.complete(self._in_flight.popleft())
            except Exception:  # a worker is gone: nothing more comes back
                logger.exception("collecting the steps in flight at shutdown")
                self._in_flight.clear()
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
            self.tp_workers = None

    def add_lora(self, name: str, path: str, replace: bool = False) -> bool:
        """Load the PEFT adapter in directory `path` as `name` (vLLM's `add_lora`) unless one of that
        name is loaded from there already; whether it loaded it now. `replace`: load it over the
        adapter of that name (vLLM's load_inplace; the old one stays if the new one fails).
        InvalidParameterError, with the model unchanged: LoRA off, the name loaded from elsewhere,
        `max_cpu_loras` adapters loaded already, tensor parallelism (every rank would have to load
        it in step), requests running under the adapter replaced, or an adapter that cannot be read
        or attached."""
        loaded = self.runner.loras.get(name)
        if loaded is not None and not replace:
            if path and path != loaded.path:
                raise InvalidParameterError("lora_path", f"a LoRA adapter named {name!r} is already loaded from "
                                            f"{loaded.path}, not {path}")  # fmt: skip
            return False
        if self.lora_limits is None:
            raise InvalidParameterError("lora_request", "this engine was built without enable_lora")
        if self.tp_workers is not None:
            raise InvalidParameterError("lora_request", "under tensor parallelism adapters load at start "
                                        "(lora_modules); this one is not among them")  # fmt: skip
        max_rank, max_loaded = self.lora_limits
        if loaded is None and len(self.runner.loras) >= max_loaded:
            raise InvalidParameterError("lora_name", f"{len(self.runner.loras)} LoRA adapters are loaded, the most "
                                        "--max-cpu-loras allows; unload one first")  # fmt: skip
        if loaded is not None:
            self._check_unused(name, loaded.slot)
        try:
            adapter = read_peft_adapter(name, path, max_rank)
        except Exception as e:  # whatever files a path leads to: unreadable, malformed, not an adapter
            raise InvalidParameterError("lora_path", f"cannot read LoRA adapter {name!r}: {e}") from None
        try:
            self.runner.add_lora(adapter, replace=replace)  # checks every layer before it changes one
        except ValueError as e:
            raise InvalidParameterError("lora_path", f"LoRA adapter {name!r} does not fit this model: {e}") from None
        except Exception as e:  # past the checks (out of memory): the runner took back what it attached
            logger.exception("attaching LoRA adapter %r", name)
            raise InvalidParameterError("lora_path", f"LoRA adapter {name!r} could not be attached: "
                                        f"{type(e).__name__}") from None  # fmt: skip
        if self.info is not None:
            self.info.lora_digests[name] = adapter.digest
        return True

    def _check_unused(self, name: str, slot: int) -> None:
        held = [*self.scheduler.requests.values(), *(r for r, _, _ in self._awaiting_grammar.values()),
                *self._embed_held]  # fmt: skip
        users = sum(r.lora_slot == slot for r in held)
        if users:
            raise LoRAInUseError("lora_name", f"{users} request(s) still run under LoRA adapter {name!r}; unload "
                                 "or replace it once they finish")  # fmt: skip

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name` (vLLM's `remove_lora`). InvalidParameterError while a request still
        runs under it (or waits to), or when none of that name is loaded. Its cached blocks stay
        in the prefix cache, out of any other adapter's reach (keyed by its name and digest)."""
        loaded = self.runner.loras.get(name)
        if loaded is None:
            raise LoRANotLoadedError("lora_name", f"no LoRA adapter named {name!r} is loaded")
        if self.tp_workers is not None:
            raise InvalidParameterError("lora_name", "under tensor parallelism adapters stay loaded")
        self._check_unused(name, loaded.slot)
        self.runner.remove_lora(name)
        if self.info is not None:
            self.info.lora_digests.pop(name, None)

    def add_request(self, request: Request | EngineCoreRequest) -> None:
        prefilled: list[int] = []
        if isinstance(request, EngineCoreRequest):
            if request.lora_name is not None and request.lora_name not in self.runner.loras:  # (a direct caller's)
                self._pending.append(self._refused(request, f"no LoRA adapter named {request.lora_name!r} is loaded"))
                return
            prefilled = request.prefilled_token_ids
            params = request.sampling_params
            # Sets do not survive the wire; EOS ids are the core's to add anyway.
            resolve_stop_token_ids(params, self.eos_token_ids)
            request = Request(
                request.request_id,
                request.prompt_token_ids,
                params,
                priority=request.priority,
                arrival_time=request.arrival_time or None,
                block_size=self.kv.block_size,
                cache_salt=request.cache_salt,
                deployment_salt=self.kv.block_hash_salt,
                lora_key=self.runner.loras[request.lora_name].key if request.lora_name else None,
                lora_slot=self.runner.loras[request.lora_name].slot if request.lora_name else -1,
                max_tokens=request.max_tokens,
            )
        if request.sampling_params.pooling is not None and self.embed_max_delay > 0:
            self._embed_held.append(request)
            return
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            if self.grammars is None:
                self._pending.append(self._refused(request, "structured output needs the model's tokenizer"))
                return
            try:
                future = self.grammars.submit(structured)
            except ValueError as e:  # the API side validates first: only a direct caller gets here
                self._pending.append(self._refused(request, str(e)))
                return
            if not future.done():
                self._awaiting_grammar[request.request_id] = (request, prefilled, future)
                return
            self._admit(request, prefilled, future)
            return
        self._admit(request, prefilled)

    def _admit(self, request: Request, prefilled: list[int], grammar: concurrent.futures.Future | None = None) -> None:
        if grammar is not None:
            try:
                state: GrammarState = grammar.result()
            except Exception as e:
                self._pending.append(self._refused(request, str(e)))
                return
            request.grammar = state
        self.scheduler.add_request(request)
        if prefilled:
            self._continue_prefilled(request, prefilled)

    def _refused(self, request: Request, why: str) -> EngineCoreOutput:
        logger.error("request %s aborted: %s", request.request_id, why)
        return EngineCoreOutput(request.request_id, [], finish_reason=RequestStatus.FINISHED_ABORTED.value)

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammars have compiled; when nothing else can run, wait a
        little for one (rather than spin the loop)."""
        if not self.scheduler.has_unfinished_requests() and not self._pending:
            futures = [f for _, _, f in self._awaiting_grammar.values()]
            concurrent.futures.wait(futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        for rid in [rid for rid, (_, _, f) in self._awaiting_grammar.items() if f.done()]:
            request, prefilled, future = self._awaiting_grammar.pop(rid)
            self._admit(request, prefilled, future)

    def _continue_prefilled(self, request: Request, tokens: list[int]) -> None:
        """A request whose prompt another worker prefilled: take the token(s) it sampled as this
        request's first, as if sampled here; the next step computes what the prefix cache lacks
        (with the imported blocks: the prompt's last partial block and these tokens) and samples on."""
        finish = None
        for token in tokens:
            request.append_token(token)
            finish = self._check_stop(request, token)
            if finish is not None:
                break
        self._pending.append(
            EngineCoreOutput(
                request.request_id,
                request.output_token_ids[:],
                finish_reason=finish,
                stop_reason=request.stop_reason if isinstance(request.stop_reason, int) else None,
                stop_token=request.stopped_by_token,
                queue_time=0.0,
            )  # fmt: skip
        )

    def _release_embeddings(self) -> None:
        """Schedule the held embedding requests once enough wait or the first has waited long
        enough; when nothing else runs, sleep a little toward that moment (new requests arrive
        between steps, so never the whole delay)."""
        due = self._embed_held[0].arrival_time + self.embed_max_delay
        now = time.monotonic()
        if len(self._embed_held) < self.embed_max_batch and now < due:
            if not self.scheduler.has_unfinished_requests() and not self._pending:
                time.sleep(min(due - now, 0.001))
            return
        for request in self._embed_held:
            self.scheduler.add_request(request)
        self._embed_held = []

    def abort_requests(self, request_ids: list[str]) -> None:
        if self._embed_held:
            gone = set(request_ids)
            self._embed_held = [r for r in self._embed_held if r.request_id not in gone]
        for rid in request_ids:
            if self._awaiting_grammar.pop(rid, None) is None:
                self.scheduler.abort_request(rid)
        if self.proposer is not None:
            self.proposer.release(request_ids)
        if self._pending:
            gone = set(request_ids)
            self._pending = [o for o in self._pending if o.request_id not in gone]

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._pending) or bool(self._awaiting_grammar)
                or bool(self._embed_held) or bool(self._in_flight))  # fmt: skip

    def step(self) -> list[EngineCoreOutput]:
        if self._awaiting_grammar:
            self._admit_compiled()
        if self._embed_held:
            self._release_embeddings()
        outputs, self._pending = self._pending, []
        self.step_tokens = 0
        if self.pipelined:
            return outputs + self._pipelined_step()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if sched.is_empty:
            return outputs
        record = StepRecord(0, 0, 0, schedule=t1 - t0)  # the runner fills in the step's shape
        requests, sampled = self.runner.execute(sched, record)
        return outputs + self._apply(sched, requests, sampled, record)

    def _pipelined_step(self) -> list[EngineCoreOutput]:
        """Fill the pipeline with micro-batches (each a share of the requests, so that the stages have
        one each), then apply the oldest one's tokens."""
        while len(self._in_flight) < self.micro_batches:
            t0 = time.perf_counter()
            share = max(1, cdiv(len(self.scheduler.requests), self.micro_batches))
            sched = self.scheduler.schedule(max_requests=share)
            t1 = time.perf_counter()
            if sched.is_empty:
                break
            self._in_flight.append(self.runner.submit(sched, StepRecord(0, 0, 0, schedule=t1 - t0)))
            self.max_in_flight = max(self.max_in_flight, len(self._in_flight))
        if not self._in_flight:
            return []
        step = self._in_flight.popleft()
        requests, sampled = self.runner.complete(step)
        return self._apply(step.sched, requests, sampled, step.record)

    def _apply(self, sched, requests: list[Request], sampled, record: StepRecord) -> list[EngineCoreOutput]:
        """A step's results: pooled embeddings finish, sampled tokens are appended and checked
        against the stop conditions, drafts verified or rolled back; the outputs to send."""
        t2 = time.perf_counter()
        self.step_tokens = sched.num_batched_tokens
        outputs: list[EngineCoreOutput] = []
        for request in self.runner.pooled:  # embeddings whose prompt is done: no token, a vector
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineCoreOutput(
                request.request_id, [], finish_reason=RequestStatus.FINISHED_STOPPED.value,
                embedding=request.embedding, queue_time=_queue_time(request),
            ))  # fmt: skip
        for i, request in enumerate(requests):
            tokens, lps = sampled.token_ids[i], sampled.logprobs[i]
            drafts = sched.spec_token_ids.get(request.request_id)
            if drafts:
                parents = sched.spec_parents.get(request.request_id)
                depth = max(tree_depths(parents)) if parents else len(drafts)  # draft positions
                self._count_verified(len(drafts), len(tokens) - 1)
                self.proposer.observe_verification(request, depth, len(tokens) - 1)
                self.scheduler.rollback(request, len(drafts) - (len(tokens) - 1))
            first_position = request.num_tokens - 1
            finish = None
            for n, token in enumerate(tokens, 1):
                request.append_token(token)
                finish = self._check_stop(request, token)
                if finish is not None:  # nothing after a stop, max_tokens or max_model_len
                    tokens, lps = tokens[:n], (lps[:n] if lps is not None else None)
                    break
            if drafts and finish is None:
                self.kv.cache_verified_blocks(request, first_position)
            first = request.num_output_tokens == len(tokens)  # this step's tokens are its first
            prompt_lps = None
            if first and request.sampling_params.prompt_logprobs is not None:
                prompt_lps, request.prompt_logprobs = request.prompt_logprobs, []
            out = EngineCoreOutput(
                request.request_id,
                tokens,
                lps,
                finish_reason=finish,
                stop_reason=request.stop_reason if isinstance(request.stop_reason, int) else None,
                stop_token=request.stopped_by_token,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                queue_time=_queue_time(request) if request.num_output_tokens == 1 else None,
                prompt_logprobs=prompt_lps,
            )
            outputs.append(out)
        if self.proposer is not None:
            if record.num_prefill_tokens == 0:  # prompt rows cost differently (GEMMs): not in the fit
                # Plan, forward and sampling together: on a GPU the forward is only queued until
                # sampling reads its logits.
                seconds = record.prepare + record.forward + record.sample
                self.proposer.observe_step(record.num_decodes, seconds, record.num_stream_rows)
            self.proposer.propose(self.scheduler.running)
        record.update = time.perf_counter() - t2
        if self.step_records is not None:
            self.step_records.append(record)
        return outputs

    def _count_verified(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1

    def _check_stop(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        status = None
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stopped_by_token = True
            elif token in params.all_stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason, request.stopped_by_token = token, True
        grammar = request.grammar
        if status is None and grammar is not None:
            if not grammar.accept(token):
                # The mask forbade it (a bug), or the matcher hit its own limits on a grammar that
                # validated: `start: "a" start` (no string ends it) runs out of parser items. The
                # error can carry the parser's whole state: only its start goes to the log, which
                # a client can write to at will this way.
                logger.warning("request %s: token %d breaks its grammar: %.300s", request.request_id, token,
                               grammar.error())  # fmt: skip
                status = RequestStatus.FINISHED_ABORTED
                self.grammars.forget(grammar)
            elif grammar.is_stopped():  # complete: nothing but EOS could follow
                status = RequestStatus.FINISHED_STOPPED
        elif status is not None and grammar is not None and grammar.failed():
            # An EOS or stop token where the matcher had failed (another copy of its grammar hit
            # llguidance's limits): the output does not follow the grammar, so it is no "stop".
            logger.warning("request %s: its grammar failed: %.300s", request.request_id, grammar.error())
            status = RequestStatus.FINISHED_ABORTED
            self.grammars.forget(grammar)
        if status is None and (
            request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.scheduler.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is None:
            return None
        self.scheduler.finish_request(request, status)
        return status.value

    def stats(self, step_tokens: int = 0) -> EngineStats:
        """The running totals; `step_tokens`: the tokens of the step these stats follow (the
        iteration-size histogram's sample), 0 for a heartbeat or a call."""
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=pool.usage(),
            num_kv_blocks=pool.num_blocks,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_evictions=pool.num_evictions,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=sum(self.spec_accepted_per_pos),
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
            step_tokens=step_tokens,
        )


def _queue_time(request: Request) -> float:
    """Seconds from arrival to first scheduling (sent with a request's first output)."""
    return (request.first_scheduled_time or request.arrival_time) - request.arrival_time
