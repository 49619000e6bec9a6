"""Iteration-level scheduler: one token budget per step shared by decode and chunked prefill.

Each step: running requests first (in priority order), each asking for the
tokens it has not computed yet (1 for decode, plus its draft tokens when
speculating, the rest of its prompt for a partial prefill); when blocks run out
it first gives up its drafts, then the lowest-priority, latest-arriving
running request is preempted (blocks freed, requeued, recomputed later).
Then waiting requests, by priority and, with prefix caching, longest cached
prefix first among the earliest few (FCFS among equals; core/waiting_queue.py),
chunked to fit what is left of the budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.request import Request, RequestStatus
from ferry.core.waiting_queue import WaitingQueue


@dataclass
class SchedulerOutput:
    # (request, number of tokens to compute this step), in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    # Every scheduled request's KV block ids, in order: all the model runner needs of the cache.
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Draft tokens scheduled for verification, by request id (their count is in `scheduled`).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Of those, the trees: each draft's parent (Request.spec_parents), by request id.
    spec_parents: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        max_loras: int | None = None,
    ) -> None:
        """`max_loras`: the most LoRA adapters the running requests may use together (vLLM's
        --max-loras); a request of another adapter waits, and those behind it go first (up to one
        queue window of such requests passed over a step). As in vLLM, steady traffic to the
        adapters running can keep another waiting."""
        self.kv = kv_cache_manager
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # Per-step limits: sequences running, tokens computed, and a sequence's whole length.
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from the queues and release its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ---------------------------------------------------------

    def schedule(self, max_requests: int | None = None) -> SchedulerOutput:
        """One step's batch. `max_requests` caps the requests in it (pipeline parallelism splits the
        requests over the micro-batches in flight). A running request with nothing left to compute
        is in a step still in flight (pipeline parallelism: its next token is not back yet) and
        waits for it."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        cap = max_requests or len(self.requests)
        self.running.sort(key=Request.sort_key)

        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < cap:
            request = self.running[i]
            if request.num_tokens == request.num_computed_tokens:
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = request.spec_token_ids[: budget - 1] if num_new == 1 else []
            num_new += len(drafts)
            scheduled = True
            while not self.kv.allocate_slots(request, num_new):
                if drafts:  # verifying drafts is optional; decoding is not
                    num_new -= len(drafts)
                    drafts = []
                    continue
                # Out of blocks: the victim is the lowest-priority, latest request.
                # Running is sorted, so it is the last one and was not scheduled yet.
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            if drafts:  # a prefix of a tree's preorder is a tree
                out.spec_token_ids[request.request_id] = drafts
                if request.spec_parents is not None:
                    out.spec_parents[request.request_id] = request.spec_parents[: len(drafts)]
            out.scheduled.append((request, num_new))
            budget -= num_new
            i += 1

        # New work only when nothing was preempted: the freed blocks belong to the victims.
        if not out.preempted:
            cached = self.kv.num_cached_prefix_tokens if self.kv.enable_prefix_caching else None
            adapters = {r.lora_slot for r in self.running if r.lora_slot >= 0}
            other_adapter: list[Request] = []  # waiting for the adapters running to finish
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(out.scheduled) < cap:
                request = self.waiting.take_next(cached)
                if (self.max_loras is not None and request.lora_slot >= 0 and request.lora_slot not in adapters
                        and len(adapters) >= self.max_loras):  # fmt: skip
                    other_adapter.append(request)
                    if len(other_adapter) >= self.waiting.window:
                        break  # a step passes over at most one window of them: a long queue costs no more
                    continue
                # An embedding pools over every prompt position, prompt logprobs read every one's
                # logits: such requests compute them all.
                p = request.sampling_params
                every = p.pooling is not None or p.prompt_logprobs is not None
                hits, num_hit_tokens = ([], 0) if every else self.kv.get_computed_blocks(request)
                num_new = request.num_tokens - num_hit_tokens
                if num_new > budget and not self.enable_chunked_prefill:
                    self.waiting.push(request)
                    break
                num_new = min(num_new, budget)
                request.num_computed_tokens = 0
                if not self.kv.allocate_slots(request, num_new, hits):
                    self.waiting.push(request)
                    break
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                    request.first_scheduled_time = time.monotonic()
                self.kv.record_prefix_lookup(request, num_hit_tokens)
                request.num_computed_tokens = num_hit_tokens
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                out.scheduled.append((request, num_new))
                budget -= num_new
                if request.lora_slot >= 0:
                    adapters.add(request.lora_slot)
            for request in other_adapter:
                self.waiting.push(request)

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        # Tokens scheduled now count as computed: their K/V are written by this step.
        for request, n in out.scheduled:
            request.num_computed_tokens += n
            out.block_ids[request.request_id] = self.kv.block_ids(request.request_id)
        return out

    def rollback(self, request: Request, num_rejected: int) -> None:
        """Forget the K/V of a step's last `num_rejected` tokens (drafts the model did not keep):
        they count as not computed, and blocks holding nothing else go back to the pool. Those
        blocks were never published to the prefix cache: their hashes need accepted tokens."""
        if num_rejected:
            request.num_computed_tokens -= num_rejected
            self.kv.trim(request, request.num_computed_tokens)

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        request.spec_parents = None
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)  # its early arrival puts it first among its priority
