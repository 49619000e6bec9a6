"""Turns a SchedulerOutput into one flat batch, runs the model once and samples.

Inputs are built with numpy on the host and copied once; the only device →
host read in a step is the sampled token ids (plus logprobs when asked).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ferry.engine.cpu_allocator import tune_cpu_allocator
from ferry.engine.kv_cache_manager import KVCacheManager
from ferry.engine.request import Request
from ferry.engine.sampler import Sampler, SamplerOutput
from ferry.engine.scheduler import SchedulerOutput
from ferry.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillHost,
    build_metadata,
    select_attention_backend,
)
from ferry.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """One step's shape and the seconds spent in each phase."""

    num_decodes: int
    num_prefill_tokens: int
    decode_context_tokens: int  # K/V positions read by the decode rows
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.update


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that need logits
    sampling_requests: list[Request]  # one per logits row
    decode_context_tokens: int = 0


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache_manager: KVCacheManager,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype | None = None,
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.kv = kv_cache_manager
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        if device.type == "cpu":
            tune_cpu_allocator()
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        cache_dtype = kv_cache_dtype or dtype
        self.kv_caches = [
            (torch.zeros(shape, dtype=cache_dtype, device=device), torch.zeros(shape, dtype=cache_dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler(cfg.vocab_size)
        self.attn_backend: AttentionBackend = select_attention_backend(
            attention_backend,
            device,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
            cache_dtype=cache_dtype,
        )
        self.profile = False  # sync the device between phases for an exact breakdown

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def prepare_inputs(self, sched: SchedulerOutput) -> BatchInputs:
        """Decode requests (1 new token) first, then prefill chunks, in one flat token list."""
        bs = self.block_size
        decodes, prefills = [], []
        for request, n in sched.scheduled:
            (decodes if n == 1 and request.num_computed_tokens > 1 else prefills).append((request, n))
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        logits_rows: list[int] = []
        sampling: list[Request] = []

        nd = len(decodes)
        decode_blocks: list[np.ndarray] = []
        seq_lens = np.empty(nd, dtype=np.int64)
        if nd:
            dec_pos = np.empty(nd, dtype=np.int64)
            dec_slot = np.empty(nd, dtype=np.int64)
            for i, (r, _) in enumerate(decodes):
                blocks = self.kv.block_ids(r.request_id)
                decode_blocks.append(np.asarray(blocks, dtype=np.int64))
                ctx = r.num_computed_tokens  # includes the token computed now
                p = ctx - 1
                seq_lens[i] = ctx
                dec_pos[i] = p
                dec_slot[i] = blocks[p // bs] * bs + p % bs
                ids.append(r.all_token_ids[p])
                if ctx == r.num_tokens:
                    logits_rows.append(i)
                    sampling.append(r)
            pos_parts.append(dec_pos)
            slot_parts.append(dec_slot)

        chunks: list[PrefillHost] = []
        start = nd
        for r, n in prefills:
            end_ctx = r.num_computed_tokens
            begin = end_ctx - n
            blocks = np.asarray(self.kv.block_ids(r.request_id), dtype=np.int64)
            pos = np.arange(begin, end_ctx, dtype=np.int64)
            ids.extend(r.all_token_ids[begin:end_ctx])
            pos_parts.append(pos)
            slot_parts.append(blocks[pos // bs] * bs + pos % bs)
            chunks.append(PrefillHost(start, n, end_ctx, blocks))
            if end_ctx == r.num_tokens:  # the chunk reaches the end: sample the next token
                logits_rows.append(start + n - 1)
                sampling.append(r)
            start += n

        meta = build_metadata(
            slot_mapping=np.concatenate(slot_parts),
            block_size=bs,
            decode_blocks=decode_blocks,
            decode_seq_lens=seq_lens,
            prefills=chunks,
            device=self.device,
            backend=self.attn_backend,
        )
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(self.device),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            sampling_requests=sampling,
            decode_context_tokens=int(seq_lens.sum()),
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, record: StepRecord) -> tuple[list[Request], SamplerOutput | None]:
        """Run one step; returns the requests that got a new token and the sampled tokens."""
        t0 = time.perf_counter()
        batch = self.prepare_inputs(sched)
        if self.profile:
            _sync(self.device)
        t1 = time.perf_counter()
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        logits = (
            self.model.compute_logits(hidden.index_select(0, batch.logits_indices)) if batch.sampling_requests else None
        )
        if self.profile:
            _sync(self.device)
        t2 = time.perf_counter()
        out = self.sampler(logits, batch.sampling_requests) if logits is not None else None
        t3 = time.perf_counter()
        meta = batch.meta
        record.num_decodes = meta.num_decodes
        record.num_prefill_tokens = sum(p.length for p in meta.prefills)
        record.decode_context_tokens = batch.decode_context_tokens
        record.prepare, record.forward, record.sample = t1 - t0, t2 - t1, t3 - t2
        return batch.sampling_requests, out
