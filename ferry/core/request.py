"""One sequence being generated, as the engine core sees it.

A user prompt with `n > 1` becomes n Requests (ids `<id>`, `<id>#1`, ...)
that share the prompt's KV blocks through the prefix cache, as in vLLM v1.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from ferry.core.block_hash import BlockHash, chain_root, hash_block_tokens
from ferry.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferry.structured_output.compiler import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        block_size: int = 16,
        cache_salt: str | None = None,
        deployment_salt: bytes | None = None,
        lora_key: str | None = None,
        lora_slot: int = -1,
        max_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.max_tokens = max_tokens  # resolved against max_model_len by the engine
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.stopped_by_token = False  # its last token is the EOS or stop token id that ended it (not text)
        # Tokens whose K/V are in the cache (or being written this step).
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at first scheduling (for usage stats).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # time.monotonic() when first scheduled
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.deployment_salt = deployment_salt
        # The LoRA adapter it runs under (layers/lora.py): its key (name and content digest) keys the
        # block hashes, its slot (-1: none) tells the model's layers which update to add to its rows.
        self.lora_key = lora_key
        self.lora_slot = lora_slot
        self._hash_root = chain_root(cache_salt, deployment_salt, lora_key)  # the first block's parent (block_hash.py)
        self.block_hashes: list[BlockHash] = []
        # Draft tokens to verify in the next step (speculative decoding); never part of the
        # sequence (nor of its block hashes) until the model accepts them.
        self.spec_token_ids: list[int] = []
        # For a tree of drafts (in preorder), each draft's parent: 0 for the last token, i for draft
        # i (1-based). None: a chain, each draft after the one before.
        self.spec_parents: list[int] | None = None
        # The key of an unseeded request's sampling noise, set when a draft model or Medusa heads draft for it:
        # the draft then samples with the noise its verification will use (worker/sampler.py).
        self.noise_seed: int | None = None
        # The sampler's tensors of `sampling_params.logit_bias`, built at the first step (worker/sampler.py).
        self.logit_bias_tensors: tuple | None = None
        # The tokens `sampling_params.allowed_token_ids` leaves out, as a vocabulary-wide mask (same).
        self.disallowed_mask: Any = None
        # Where the request stands in its grammar (structured output; set by the engine core once
        # compiled): the sampler masks what it forbids, each kept token advances it.
        self.grammar: GrammarState | None = None
        # An embedding request (sampling_params.pooling): its pooled hidden state so far (a sum over
        # the chunks computed, for mean pooling; worker/pooler.py), and the finished vector.
        self.pooled: Any = None
        self.embedding: list[float] | None = None
        # sampling_params.prompt_logprobs: per prompt position from the second, (logprob, rank, top
        # ids, top logprobs) of its token, filled chunk by chunk (worker/prompt_logprobs.py) and sent
        # with the first output token.
        self.prompt_logprobs: list[tuple[float, int, list[int], list[float]]] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.all_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (a draft model's copy of a request dropping the
        drafts the target did not keep), and the hashes of the blocks they still fill."""
        del self.all_token_ids[num_tokens:]
        del self.output_token_ids[max(num_tokens - len(self.prompt_token_ids), 0) :]
        del self.block_hashes[num_tokens // self.block_size :]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def _update_block_hashes(self) -> None:
        """Hash every newly completed full block (chained on the previous hash)."""
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else self._hash_root
            self.block_hashes.append(hash_block_tokens(parent, self.all_token_ids[i * bs : (i + 1) * bs]))

    def sort_key(self) -> tuple[int, float]:
        """Lower runs first: priority, then arrival (FCFS)."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/{self.num_tokens})"
        )
