"""Speculative decoding's worker side: proposers of draft tokens (ngram.py: prompt lookup;
draft_model.py: a draft model; early_exit.py: the target's first layers, over its own cache;
medusa.py: heads on the target's hidden state) and how many to verify
(draft_length.py; the sampler verifies them, worker/sampler.py: `Sampler.verify`).

After each step `DraftProposer.propose` gives every decoding request up to
`num_speculative_tokens` drafts (`Request.spec_token_ids`); the scheduler gives it 1 + k tokens
of budget and KV slots, the step plan lays them out as k + 1 decode rows over the request's
blocks (each attends to the rows before it, written into the cache in the same layer), the
sampler keeps the longest agreeing prefix plus one token of the model's own, and the scheduler
rolls the rejected drafts' slots back (core/scheduler.py: `rollback`).
"""

from __future__ import annotations

import random

from ferry.config import SpeculativeConfig
from ferry.core.request import Request
from ferry.worker.spec_decode.draft_length import AdaptiveDraftLength
from ferry.worker.spec_decode.draft_model import DraftModelProposer
from ferry.worker.spec_decode.early_exit import EarlyExitProposer
from ferry.worker.spec_decode.medusa import MedusaProposer
from ferry.worker.spec_decode.ngram import NgramProposer


class DraftProposer:
    """Drafts for the requests of the next step, within what each may still produce, as many as
    pay for themselves (draft_length.py) unless `draft_length` is "fixed"."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        draft_model: DraftModelProposer | EarlyExitProposer | None = None,
        medusa: MedusaProposer | None = None,
        seed: int = 0,
    ) -> None:
        """`draft_model` drafts for the draft_model and early_exit methods, `medusa` for medusa
        (neither: ngram); `seed` keys the noise of unseeded sampling requests they draft for."""
        self.config = config
        self.max_model_len = max_model_len
        self.draft_model = draft_model
        self.medusa = medusa
        self.ngram = (
            None if draft_model or medusa else NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        )
        self.rng = random.Random(seed)
        # None: every draft found is verified ("fixed", as vLLM does).
        self.policy = AdaptiveDraftLength(config.num_speculative_tokens) if config.draft_length == "adaptive" else None

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` of every running request (empty where it gets none): only
        requests about to decode get drafts, never more than leave room for the token the model
        adds after them within max_tokens and max_model_len, and none at all in a batch larger
        than `disable_by_batch_size`."""
        cap = self.config.disable_by_batch_size
        off = cap is not None and len(running) > cap
        decoding: list[Request] = []
        rooms: list[int] = []
        for request in running:
            request.spec_token_ids = []
            request.spec_parents = None
            if off or request.num_computed_tokens != request.num_tokens - 1:
                continue
            decoding.append(request)
            rooms.append(max(0, min(
                self.config.num_speculative_tokens,
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )))  # fmt: skip
        if self.draft_model is not None or self.medusa is not None:
            # Decide first: a draft model's drafts cost a pass each, Medusa heads' a head each
            # (counts are how deep; a Medusa tree has more drafts than that, each its own row).
            counts = self.policy.choose(decoding, rooms) if self.policy else rooms
            for request, n in zip(decoding, counts):
                # A drafter samples with the noise the target's row will use: an unseeded request
                # needs a key for it (worker/sampler.py: `Sampler.draft`).
                params = request.sampling_params
                if n and not params.greedy and params.seed is None and request.noise_seed is None:
                    request.noise_seed = self.rng.getrandbits(63)
            if self.draft_model is not None:
                candidates = self.draft_model.propose(running, decoding, counts)
                passes = self.draft_model.take_pass_times()
            else:
                candidates = self.medusa.propose(decoding, counts)
                passes = self.medusa.take_pass_times()
            if self.policy:
                for num_requests, seconds in passes:
                    self.policy.observe_draft_pass(num_requests, seconds)
            for request, drafts in zip(decoding, candidates):
                request.spec_token_ids = drafts
            return
        # n-gram drafts cost next to nothing: find them, then choose how many to verify.
        candidates = [self.ngram.propose(r, room) if room else [] for r, room in zip(decoding, rooms)]
        found = [len(c) for c in candidates]
        counts = self.policy.choose(decoding, found) if self.policy else found
        for request, drafts, n in zip(decoding, candidates, counts):
            request.spec_token_ids = drafts[:n]

    def release(self, request_ids: list[str]) -> None:
        """These requests are gone (aborted): free what the draft model holds for them."""
        if self.draft_model is not None:
            self.draft_model.release(request_ids)

    def observe_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The step verified `num_drafts` drafts of the request and kept the first `num_accepted`."""
        if self.policy:
            self.policy.observe_verification(request, num_drafts, num_accepted)

    def observe_step(self, num_rows: int, seconds: float, num_stream_rows: int = 0) -> None:
        """A decode-only step ran `num_rows` rows in `seconds`, `num_stream_rows` of them through
        early exit's last layers only."""
        if self.policy:
            self.policy.observe_step(num_rows, seconds, num_stream_rows)
