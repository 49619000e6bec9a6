"""Drafts from a smaller model (`draft_model`): k autoregressive steps of the draft, batched over
the requests. (Early exit, whose draft is the target's first layers, drafts over the target's own
cache: early_exit.py.)

The draft has its own runner and its own paged KV cache, managed in step with the target's: each
running request has a shadow request in the draft's KVCacheManager (prefix caching included, so
n > 1 siblings and shared system prompts share draft blocks too). Before drafting, a shadow is
brought to its request's tokens: it keeps the K/V of the longest prefix both agree on (the drafts
the target kept), drops the rest, and the first draft pass feeds what is new (the target's own
token after the kept drafts; a whole prompt for a new shadow, chunked to the token budget). Each
further pass feeds the previous draft as one decode row. A shadow whose request stops running
(finished, aborted, preempted) is freed at the next proposal; a shadow the draft's cache cannot
hold gets no drafts (the target decodes on without them).

Drafts are drawn with the request's own sampling (sampler.py: `Sampler.draft`), with the noise
the target's verify row will use, so a sampled draft is kept exactly when it equals the target's
draw.
"""

from __future__ import annotations

import itertools
import time

import torch

from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.request import Request
from ferry.core.scheduler import SchedulerOutput
from ferry.worker.model_loading import LoadedModel
from ferry.worker.model_runner import ModelRunner
from ferry.worker.sampler import Sampler
from ferry.worker.step_plan import build_step_plan

# A shadow's first pass feeds up to this many tokens (the kept drafts and the target's token) as
# decode rows; more (a prompt) go through the prompt path.
MAX_DECODE_ROWS_FEED = 16


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft's token ids must mean what the target's mean: the same tokenizer vocabulary (or,
    for checkpoints without a tokenizer, the same vocabulary size)."""
    t, d = target.tokenizer, draft.tokenizer
    if t is not None and d is not None:
        if t is d or t.get_vocab() == d.get_vocab():
            return
        raise ValueError(
            f"the draft model's tokenizer ({draft.path}) differs from the target's ({target.path}); "
            "speculative decoding needs both to map text to the same token ids"
        )
    tv, dv = target.model.config.vocab_size, draft.model.config.vocab_size
    if tv != dv:
        raise ValueError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv})")


class DraftModelProposer:
    """`propose` drafts for decoding requests with a draft model over its own KV cache."""

    def __init__(
        self, runner: ModelRunner, kv: KVCacheManager, target_vocab_size: int, max_num_batched_tokens: int
    ) -> None:
        self.runner = runner
        self.kv = kv
        self.sampler = Sampler(runner.model.config.vocab_size)
        self.target_vocab_size = target_vocab_size
        self.max_num_batched_tokens = max_num_batched_tokens  # per draft forward
        self.shadows: dict[str, Request] = {}
        # Per shadow, how many of its first tokens are its request's (the rest are drafts): only
        # those after it need comparing when the shadow is next brought up to date.
        self._agreed: dict[str, int] = {}
        self._pass_times: list[tuple[int, float]] = []  # (requests drafted for, seconds) per pass

    def take_pass_times(self) -> list[tuple[int, float]]:
        """The passes since the last call: (requests each drafted a token for, seconds)."""
        times, self._pass_times = self._pass_times, []
        return times

    def release(self, request_ids: list[str]) -> None:
        """Free the shadows (and their draft KV blocks) of these requests."""
        for rid in request_ids:
            shadow = self.shadows.pop(rid, None)
            self._agreed.pop(rid, None)
            if shadow is not None:
                self.kv.free(shadow)

    def propose(self, running: list[Request], requests: list[Request], rooms: list[int]) -> list[list[int]]:
        """Up to rooms[i] drafts for requests[i] (each about to decode); shadows of requests no
        longer in `running` are freed first."""
        alive = {r.request_id for r in running}
        self.release([rid for rid in self.shadows if rid not in alive])
        drafts: list[list[int]] = [[] for _ in requests]
        todo: dict[int, int] = {}  # request index -> drafts it still wants
        feeds: list[tuple[int, int]] = []  # request index, tokens the first pass feeds
        catching_up = False  # a new shadow's first pass computes its whole prompt: not a draft pass's cost
        for i, (request, room) in enumerate(zip(requests, rooms)):
            if room <= 0:
                continue
            catching_up |= request.request_id not in self.shadows
            n = self._sync(request, room)
            if n is None:
                continue
            todo[i] = room
            feeds.append((i, n))
        if not feeds:
            return drafts
        self._first_pass(requests, feeds, drafts, timed=not catching_up)
        while True:
            rows = [(i, 1) for i, room in todo.items() if len(drafts[i]) < room]
            if not rows:
                return drafts
            for i, _ in rows:
                shadow = self.shadows[requests[i].request_id]
                shadow.append_token(drafts[i][-1])
            self._forward(requests, rows, drafts)

    def _sync(self, request: Request, room: int) -> int | None:
        """Bring the request's shadow to its tokens, with slots for `room` drafts; how many of its
        tokens the first pass feeds (None: the draft's cache has no room for them)."""
        bs = self.kv.block_size
        shadow = self.shadows.get(request.request_id)
        hits = []
        if shadow is None:
            # Salted as the request is: the draft's prefix cache is shared across tenants too.
            shadow = Request(request.request_id, request.all_token_ids, request.sampling_params, block_size=bs,
                             cache_salt=request.cache_salt, deployment_salt=request.deployment_salt,
                             max_tokens=request.max_tokens)  # fmt: skip
            hits, num_hit = self.kv.get_computed_blocks(shadow)
            self.kv.record_prefix_lookup(shadow, num_hit)
        else:
            # K/V stays valid over the longest prefix of computed tokens both agree on; the
            # request's last token is fed again either way (its logits give the first draft).
            keep = min(shadow.num_computed_tokens, request.num_tokens - 1)
            theirs, ours = request.all_token_ids, shadow.all_token_ids
            same = min(self._agreed[request.request_id], keep)
            while same < keep and theirs[same] == ours[same]:
                same += 1
            shadow.truncate(same)
            self.kv.trim(shadow, same)
            for token in theirs[same:]:
                shadow.append_token(token)
        cached = len(hits) * bs
        feed = request.num_tokens - shadow.num_computed_tokens - cached
        # Slots for the fed tokens and every draft but the last (never fed back).
        if not self.kv.allocate_slots(shadow, feed + room - 1, hits):
            self.kv.free(shadow)
            self.release([request.request_id])
            return None
        shadow.num_computed_tokens += cached
        self.shadows[request.request_id] = shadow
        self._agreed[request.request_id] = request.num_tokens
        return feed

    def _first_pass(
        self, requests: list[Request], feeds: list[tuple[int, int]], drafts: list[list[int]], timed: bool
    ) -> None:
        """Feed each shadow what it lacks, within the token budget per forward (a long prompt
        in chunks), and draw each request's first draft from its last token's logits."""
        budget = self.max_num_batched_tokens
        pending = list(feeds)
        while pending:
            rows, left, rest = [], budget, []
            for i, n in pending:
                take = min(n, left)
                if take:
                    rows.append((i, take))
                    left -= take
                if n > take:
                    rest.append((i, n - take))
            self._forward(requests, rows, drafts, timed and not rest)
            pending = rest

    @torch.inference_mode()
    def _forward(
        self, requests: list[Request], rows: list[tuple[int, int]], drafts: list[list[int]], timed: bool = True
    ) -> None:
        """One draft forward over (request index, tokens to compute) pairs; a shadow whose fed
        tokens reach its end gets its next draft. `timed`: the pass counts in `take_pass_times`."""
        start = time.perf_counter()
        sched = SchedulerOutput()
        for i, n in rows:
            shadow = self.shadows[requests[i].request_id]
            first = shadow.num_computed_tokens
            shadow.num_computed_tokens += n
            sched.scheduled.append((shadow, n))
            sched.block_ids[shadow.request_id] = self.kv.block_ids(shadow.request_id)
            if 1 < n <= MAX_DECODE_ROWS_FEED and first > 0:
                # The kept drafts and the target's token: laid out as decode rows, as a verify
                # step lays out drafts (the decode kernels, not the prompt path, take them).
                sched.spec_token_ids[shadow.request_id] = shadow.all_token_ids[first + 1 : first + n]
        plan, sampling, laid_out = build_step_plan(sched, self.kv.block_size)
        logits = self.runner.forward(plan)
        if logits is None:
            return
        if sched.spec_token_ids:  # rows laid out as drafts each got logits: keep each one's last
            ends = itertools.accumulate(len(fed) + 1 for fed in laid_out)
            logits = logits[torch.tensor([end - 1 for end in ends], device=logits.device)]
        if logits.shape[-1] > self.target_vocab_size:  # padding rows the target cannot take
            logits[:, self.target_vocab_size :] = float("-inf")
        index = {requests[i].request_id: i for i, _ in rows}
        order = [index[shadow.request_id] for shadow in sampling]
        tokens = self.sampler.draft(logits, [requests[i] for i in order], [drafts[i] for i in order])
        for i, token in zip(order, tokens):
            drafts[i].append(token)
        if timed:  # `tolist` waited for the device
            self._pass_times.append((len(tokens), time.perf_counter() - start))
