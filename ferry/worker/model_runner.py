"""Turns a SchedulerOutput into one flat batch, runs the model once and samples.

Inputs are built with numpy on the host and copied once; the only device →
host read in a step is the sampled token ids (plus logprobs when asked).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ferry.distributed.parallel_state import SINGLE, TensorParallel
from ferry.engine.cpu_allocator import tune_cpu_allocator
from ferry.engine.cuda_graphs import CUDAGraphRunner
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.request import Request
from ferry.engine.sampler import Sampler, SamplerOutput
from ferry.core.scheduler import SchedulerOutput
from ferry.layers.attention import AttentionBackend, PrefillHost, build_metadata, select_attention_backend
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
class StepPlan:
    """One step's inputs on the host; what rank 0 broadcasts to the other tensor-parallel ranks."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    decode_blocks: list[np.ndarray]  # per decode row, its block ids
    decode_seq_lens: np.ndarray  # [num_decodes] int64
    prefills: list[PrefillHost]
    logits_rows: np.ndarray  # rows of the batch that need logits

    @property
    def num_decodes(self) -> int:
        return len(self.decode_blocks)


class ModelRunner:
    """Builds each step's inputs and runs the model on this rank's shard; rank 0 also samples.

    The KV cache is allocated after construction (`allocate_kv_cache`), so that on a GPU
    its size can come from the memory left after a profiling forward pass."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache_manager: KVCacheManager | None,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype | None = None,
        attention_backend: str = "auto",
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.model = model
        self.kv = kv_cache_manager  # rank 0 only
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.tp = tp
        if device.type == "cpu":
            tune_cpu_allocator()
        cfg = model.config
        self.cache_dtype = kv_cache_dtype or dtype
        self.num_kv_heads = model.layers[0].self_attn.num_kv_heads  # this rank's
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sampler = Sampler(cfg.vocab_size)
        self.attn_backend: AttentionBackend = select_attention_backend(
            attention_backend,
            device,
            num_heads=model.layers[0].self_attn.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
            cache_dtype=self.cache_dtype,
        )
        self.graphs: CUDAGraphRunner | None = None
        self.check_peers: Callable[[], None] | None = None  # raises if a TP worker is gone
        self.profile = False  # sync the device between phases for an exact breakdown

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
        """Bytes of one block on one rank (its share of the KV heads)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * (cfg.num_key_value_heads // tp_size) * cfg.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model.config
        shape = (num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.cache_dtype, device=self.device),
             torch.zeros(shape, dtype=self.cache_dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]  # fmt: skip

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, chunk: int, num_seqs: int) -> int:
        """Peak CUDA bytes of a forward over `num_tokens` prompt tokens (in chunks of at most
        `chunk`) plus the logits and sampling of `num_seqs` rows, with a KV cache just big enough
        (freed after): what the KV cache must leave free. Every rank runs it together (the
        forward has collectives)."""
        bs = self.block_size
        starts = list(range(0, num_tokens, chunk))
        per_chunk = -(-chunk // bs)
        blocks = per_chunk * len(starts)
        self.allocate_kv_cache(blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        vocab = self.model.config.vocab_size
        pos = np.concatenate([np.arange(min(chunk, num_tokens - s), dtype=np.int64) for s in starts])
        prefills, slots = [], []
        for i, s in enumerate(starts):
            n = min(chunk, num_tokens - s)
            table = np.arange(i * per_chunk, (i + 1) * per_chunk, dtype=np.int64)
            prefills.append(PrefillHost(s, n, n, table))
            slots.append(table[np.arange(n) // bs] * bs + np.arange(n) % bs)
        plan = StepPlan(
            input_ids=pos % vocab,
            positions=pos,
            slot_mapping=np.concatenate(slots),
            decode_blocks=[],
            decode_seq_lens=pos[:0],
            prefills=prefills,
            logits_rows=np.full(min(num_seqs, num_tokens), num_tokens - 1, dtype=np.int64),
        )
        logits = self.forward(plan)
        if logits is not None:
            # The sampler's temporaries at their largest: penalties, top-k/p (sorted values, their
            # int64 indices, mask, probabilities, cumulative sum), noise, logprobs: ~8 fp32 copies.
            scratch = [logits.float() for _ in range(8)]
            del scratch
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak - self.kv_bytes_per_block(self.model.config, bs, self.cache_dtype, self.tp.size) * blocks

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """CUDA graphs for decode-only batches (Triton backend); every rank captures together."""
        if self.device.type != "cuda" or self.attn_backend.name != "triton":
            return
        self.graphs = CUDAGraphRunner(self, max_num_seqs, max_model_len)
        self.graphs.capture()

    def plan_step(self, sched: SchedulerOutput) -> tuple[StepPlan, list[Request]]:
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

        plan = StepPlan(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=np.concatenate(pos_parts),
            slot_mapping=np.concatenate(slot_parts),
            decode_blocks=decode_blocks,
            decode_seq_lens=seq_lens,
            prefills=chunks,
            logits_rows=np.asarray(logits_rows, dtype=np.int64),
        )
        return plan, sampling

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor | None:
        """This rank's forward over the step; the logits of `plan.logits_rows` (all ranks)."""
        if self.graphs is not None and self.graphs.fits(plan):
            hidden = self.graphs.run(plan)
        else:
            meta = build_metadata(
                slot_mapping=plan.slot_mapping,
                block_size=self.block_size,
                decode_blocks=plan.decode_blocks,
                decode_seq_lens=plan.decode_seq_lens,
                prefills=plan.prefills,
                device=self.device,
                backend=self.attn_backend,
            )
            ids = torch.from_numpy(plan.input_ids).to(self.device, non_blocking=True)
            positions = torch.from_numpy(plan.positions).to(self.device, non_blocking=True)
            hidden = self.model(ids, positions, self.kv_caches, meta)
        if not len(plan.logits_rows):
            return None
        rows = torch.from_numpy(plan.logits_rows).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def execute(self, sched: SchedulerOutput, record: StepRecord) -> tuple[list[Request], SamplerOutput | None]:
        """Run one step (rank 0); returns the requests that got a new token and the sampled tokens."""
        t0 = time.perf_counter()
        plan, sampling = self.plan_step(sched)
        if self.tp.size > 1:
            if self.check_peers is not None:
                self.check_peers()
            self.tp.broadcast_object(plan)
        if self.profile:
            _sync(self.device)
        t1 = time.perf_counter()
        logits = self.forward(plan)
        if self.profile:
            _sync(self.device)
        t2 = time.perf_counter()
        out = self.sampler(logits, sampling) if logits is not None else None
        t3 = time.perf_counter()
        record.num_decodes = plan.num_decodes
        record.num_prefill_tokens = sum(p.length for p in plan.prefills)
        record.decode_context_tokens = int(plan.decode_seq_lens.sum())
        record.prepare, record.forward, record.sample = t1 - t0, t2 - t1, t3 - t2
        return sampling, out
