"""Early-exit self-speculation (LayerSkip) over the target's own KV cache: the target's first
`draft_layers` layers, its final norm and LM head draft (`LlamaForCausalLM.first_layers`), and the
target's verification reuses what they computed.

The draft writes its K/V where the target would: into the target's cache of those layers, at
the slots of the request's own blocks. So before drafting, the proposer takes the slots of the
request's last token and of its drafts in the target's KV cache manager (not published to the
prefix cache: until the target verifies them, only the first layers' K/V are there; and only
while the blocks running requests need for the tokens they have stay free, so that drafting
preempts no one). Pass 1
feeds every request's last token, pass j its (j - 1)-th draft; the last pass a request takes
part in feeds its last draft without drawing from it. Every fed row's residual stream after the
draft's layers is kept (`ExitState`).

The next step then verifies from there (ModelRunner: `_execute_from_streams`): a request's rows
(its last token and its drafts) run only the target's last layers (`last_layers`), starting from
those streams, so their first layers' work and K/V are the draft's. Each row's numbers are what the
whole model would compute for it: the same layers over the same cache, one row at a time in both.
A stream serves only the step right after its proposal, for the rows it was computed for (same
position and tokens, no preemption since); any other row runs the whole model, rewriting the
first layers' K/V with its own (the same values).

Unlike a draft model, early exit needs no cache of its own and no shadow requests: a prompt is
never fed twice, and the draft's blocks are the request's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.request import Request
from ferry.core.scheduler import SchedulerOutput
from ferry.models.llama import LlamaForCausalLM
from ferry.worker.model_runner import ModelRunner
from ferry.worker.sampler import Sampler
from ferry.worker.step_plan import decode_rows_plan


@dataclass
class ExitState:
    """What one proposal left for a request's next verification."""

    position: int  # of the request's last token: the first row's
    preemptions: int  # the request's preemption count then
    tokens: list[int]  # the rows fed: the last token, then drafts
    stream: torch.Tensor  # [len(tokens), hidden]: each row's residual stream after the draft's layers


class EarlyExitProposer:
    """`propose` drafts with the target's first layers, over the target's cache;
    `streams_for` hands the next step the rows' residual streams it may start the last layers from."""

    def __init__(self, draft: ModelRunner, target: ModelRunner, kv: KVCacheManager) -> None:
        """`draft`: a runner over `target.model.first_layers(n)` (no cache of its own); `kv`: the
        target's KV cache manager."""
        self.runner = draft
        self.target = target
        self.kv = kv
        self.num_layers = len(draft.model.layers)
        self.rest: LlamaForCausalLM = target.model.last_layers(self.num_layers)
        self.sampler = Sampler(draft.model.config.vocab_size)
        self.states: dict[str, ExitState] = {}
        self.num_reused_rows = 0  # rows verified from a draft's stream (only the last layers run)
        self._pass_times: list[tuple[int, float]] = []

    def take_pass_times(self) -> list[tuple[int, float]]:
        """The passes that drew drafts since the last call: (requests each fed a row for, seconds),
        the last pass of a proposal (which draws nothing) counted in the one before it."""
        times, self._pass_times = self._pass_times, []
        return times

    def release(self, request_ids: list[str]) -> None:
        """These requests are gone: their streams with them (their slots are the request's)."""
        for rid in request_ids:
            self.states.pop(rid, None)

    def propose(self, running: list[Request], requests: list[Request], rooms: list[int]) -> list[list[int]]:
        """Up to rooms[i] drafts for requests[i] (each about to decode: its last token not yet
        computed), their first layers' K/V written and their streams kept."""
        self.states = {}
        drafts: list[list[int]] = [[] for _ in requests]
        room: dict[int, int] = {}  # request index -> drafts it takes
        # What running requests need for the tokens they have comes first; a drafting request's own
        # need is part of what its allocation takes.
        short = self.kv.blocks_short(running)
        for i, (request, n) in enumerate(zip(requests, rooms)):
            if n <= 0:
                continue
            own = self.kv.blocks_short([request])
            if self.kv.allocate_slots(request, n + 1, publish=False, keep_free=short - own):
                room[i] = n
                short -= own
        if not room:
            return drafts
        self.runner.kv_caches = self.target.kv_caches[: self.num_layers]
        tables = {i: self.kv.block_ids(requests[i].request_id) for i in room}  # fixed while it drafts
        fed: dict[int, list[torch.Tensor]] = {i: [] for i in room}
        for j in range(max(room.values()) + 1):  # pass j feeds row j: the last token, then draft j
            fed_now = [i for i, n in room.items() if n >= j]  # in row order
            rows, logits_rows, draw = [], [], []
            for row, i in enumerate(fed_now):
                request = requests[i]
                token = request.all_token_ids[-1] if j == 0 else drafts[i][j - 1]
                rows.append((token, request.num_computed_tokens + j, tables[i]))
                if j < room[i]:  # its next draft is drawn from this row
                    logits_rows.append(row)
                    draw.append(i)
            start = time.perf_counter()
            logits, stream = self.runner.forward_stream(decode_rows_plan(rows, self.kv.block_size, logits_rows))
            for row, i in enumerate(fed_now):
                fed[i].append(stream[row])
            if draw:
                tokens = self.sampler.draft(logits, [requests[i] for i in draw], [drafts[i] for i in draw])
                for i, token in zip(draw, tokens):
                    drafts[i].append(token)
            elif stream.is_cuda:  # nothing read back from this pass: wait for it to be timed
                torch.cuda.synchronize(stream.device)
            seconds = time.perf_counter() - start
            if draw:
                self._pass_times.append((len(rows), seconds))
            else:  # the last pass draws nothing: the draft length policy prices a pass per draft
                num_requests, before = self._pass_times[-1]  # (so the drafts' passes carry its cost)
                self._pass_times[-1] = (num_requests, before + seconds)
        for i in room:
            request = requests[i]
            self.states[request.request_id] = ExitState(
                request.num_computed_tokens, request.num_preemptions,
                [request.all_token_ids[-1], *drafts[i]], torch.stack(fed[i]),
            )  # fmt: skip
        return drafts

    def streams_for(self, sched: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Per scheduled request whose every row this step the last proposal fed (same position,
        same tokens, not preempted since), those rows' streams; the proposal's states are spent."""
        states, self.states = self.states, {}
        streams = {}
        for request, n in sched.scheduled:
            state = states.get(request.request_id)
            if state is None:
                continue
            first = request.num_computed_tokens - n  # the scheduler has counted the step's tokens
            drafts = sched.spec_token_ids.get(request.request_id, [])
            if (
                first != state.position
                or request.num_preemptions != state.preemptions
                or n != len(drafts) + 1
                or n > len(state.tokens)
                or state.tokens[:n] != [request.all_token_ids[first], *drafts]
            ):
                continue
            streams[request.request_id] = state.stream[:n]
            self.num_reused_rows += n
        return streams
