"""One rank's execution: turns a SchedulerOutput into one flat batch (step_plan.py), runs the
model once on this rank's shard and, on rank 0, samples.

Inputs are built with numpy on the host and copied once; the only device -> host read in a
step is the sampled token ids (plus logprobs when asked). The runner is built whole; its KV
cache comes later (`initialize_kv_cache`), because on a GPU its size is what a profiling
forward pass leaves free (memory.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ferry.config import EngineArgs
from ferry.core.request import Request
from ferry.core.scheduler import SchedulerOutput
from ferry.distributed.parallel_state import SINGLE, TensorParallel
from ferry.layers.attention import AttentionBackend, build_metadata, select_attention_backend
from ferry.models.llama import LlamaForCausalLM
from ferry.worker.cpu_allocator import tune_cpu_allocator
from ferry.worker.cuda_graphs import CUDAGraphRunner
from ferry.worker.model_loading import LoadedModel, resolve_kv_cache_dtype
from ferry.worker.pooler import pool_step
from ferry.worker.prompt_logprobs import prompt_logprobs
from ferry.worker.sampler import Sampler, VerifiedOutput
from ferry.worker.step_plan import StepPlan, StepRecord, build_step_plan

logger = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelRunner:
    """Runs the model on this rank's shard over each step's plan; rank 0 also plans and samples."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype | None = None,
        attention_backend: str = "auto",
        tp: TensorParallel = SINGLE,
        check_peers: Callable[[], None] | None = None,
    ) -> None:
        """`check_peers` (rank 0 under tensor parallelism) raises if another rank's process is
        gone: a collective with it would block for ever."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.check_peers = check_peers
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
            # A local/global mix is not run yet (the builder caps max_model_len to the window instead).
            sliding_window=None if cfg.full_attention_layers else cfg.sliding_window,
            latent=cfg.is_mla,
        )
        # The window this runner's attention applies (None: full attention, or a backend without windows).
        self.sliding_window: int | None = getattr(self.attn_backend, "sliding_window", None)
        self.graphs: CUDAGraphRunner | None = None
        # The last step's hidden states (the LM head's input) of its logits rows, the requests that
        # sampled in it and, per request, the row whose draw is its last token: what Medusa heads
        # draft from (`last_row_of`).
        self.logits_hidden: torch.Tensor | None = None
        # Embeddings (worker/pooler.py): the last step's hidden states when it had embedding rows,
        # the requests it finished embedding, and the pooling of requests that name none.
        self.pool_hidden: torch.Tensor | None = None
        self.pooled: list[Request] = []
        self.pooling_type = "last"
        self.prompt_lps: list = []  # the last step's prompt logprobs (worker/prompt_logprobs.py)
        self._sampled: list[Request] = []
        self._sampled_rows: list[int] = []
        self.profile = False  # sync the device between phases for an exact breakdown

    @classmethod
    def create(
        cls,
        args: EngineArgs,
        loaded: LoadedModel,
        tp: TensorParallel = SINGLE,
        check_peers: Callable[[], None] | None = None,
    ) -> "ModelRunner":
        """The runner the engine's arguments describe, over an already loaded model."""
        runner = cls(
            loaded.model,
            block_size=args.block_size,
            device=loaded.device,
            dtype=loaded.dtype,
            kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, loaded.dtype),
            attention_backend=args.attention_backend,
            tp=tp,
            check_peers=check_peers,
        )
        runner.pooling_type = args.pooling_type
        return runner

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Per layer, a (K, V) pair of [num_blocks, block_size, kv_heads, head_dim] tensors (head_dim + 4
        for a quantized cache: each row's fp32 scale follows its values); MLA's one latent tensor."""
        self.kv_caches = self.model.new_kv_cache(num_blocks, self.block_size, self.cache_dtype, self.device)

    def free_kv_cache(self) -> None:
        """Drop the cache and the CUDA graphs captured over it (their memory goes with them)."""
        self.kv_caches = []
        self.graphs = None

    def initialize_kv_cache(self, num_blocks: int, max_num_seqs: int, max_model_len: int, enforce_eager: bool) -> None:
        """Allocate the KV cache, then capture CUDA graphs for decode-only batches (on CUDA with
        the Triton backend, unless `enforce_eager`); every rank does this together."""
        self.allocate_kv_cache(num_blocks)
        if self.model.config.moe_layers and not enforce_eager and self.device.type == "cuda":
            # The grouped experts size their GEMMs on the host (layers/moe.py): nothing to replay.
            logger.info("no CUDA graphs: mixture-of-experts layers group their tokens on the host")
            enforce_eager = True
        if not enforce_eager and self.device.type == "cuda" and self.attn_backend.name == "triton":
            self.graphs = CUDAGraphRunner(
                self.model, self.attn_backend, self.kv_caches, self.block_size, self.device, max_num_seqs, max_model_len
            )
            self.graphs.capture()

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
                decode_tree=plan.decode_tree,
            )
            ids = torch.from_numpy(plan.input_ids).to(self.device, non_blocking=True)
            positions = torch.from_numpy(plan.positions).to(self.device, non_blocking=True)
            hidden = self.model(ids, positions, self.kv_caches, meta)
        self.pool_hidden = hidden if plan.pool_chunks else None
        if plan.prompt_logprob_chunks:
            self.prompt_lps = prompt_logprobs(plan, hidden, self.model.compute_logits)
        if not len(plan.logits_rows):
            self.logits_hidden = None
            return None
        rows = torch.from_numpy(plan.logits_rows).to(self.device, non_blocking=True)
        self.logits_hidden = hidden.index_select(0, rows)
        return self.model.compute_logits(self.logits_hidden)

    def last_row_of(self) -> dict[str, int]:
        """Per request that sampled in the last step, its row of `logits_hidden` whose draw is its
        last token (built when asked: only Medusa heads and train-draft need it)."""
        return {r.request_id: row for r, row in zip(self._sampled, self._sampled_rows)}

    @torch.inference_mode()
    def _move_kept_drafts(self, sched: SchedulerOutput, requests: list[Request], kept: list[list[int]]) -> None:
        """Tree verification kept a path whose drafts were stored apart (their preorder slots):
        copy their K/V, in every layer, to the slots right after the request's last token, where
        the sequence has them from now on (the rest is rolled back)."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.block_size
        for request, nodes in zip(requests, kept):
            if request.request_id not in sched.spec_parents or nodes == list(range(1, len(nodes) + 1)):
                continue
            blocks = sched.block_ids[request.request_id]
            root = request.num_tokens - 1  # the last token, before the kept ones are appended
            for depth, node in enumerate(nodes, 1):
                if node != depth:
                    src.append(blocks[(root + node) // bs] * bs + (root + node) % bs)
                    dst.append(blocks[(root + depth) // bs] * bs + (root + depth) % bs)
        if not src:
            return
        src_t = torch.tensor(src, device=self.device)
        dst_t = torch.tensor(dst, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat[dst_t] = flat.index_select(0, src_t)

    def execute(self, sched: SchedulerOutput, record: StepRecord) -> tuple[list[Request], VerifiedOutput | None]:
        """Run one step (rank 0): plan -> forward (every rank) -> sample (and verify drafts);
        returns the requests that got new tokens and, per request, the tokens it keeps."""
        t0 = time.perf_counter()
        plan, sampling, drafts = build_step_plan(sched, self.block_size)
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
        # A request without drafts is verified with none: its one row's draw is its token.
        out = None
        if logits is not None:
            parents = [sched.spec_parents.get(r.request_id) for r in sampling] if sched.spec_parents else None
            out = self.sampler.verify(logits, sampling, drafts, parents)
            if parents:
                self._move_kept_drafts(sched, sampling, out.kept_nodes)
        self._sampled, self._sampled_rows = (sampling, out.last_rows) if out is not None else ([], [])
        by_id = {r.request_id: r for r, _ in sched.scheduled} if plan.prompt_logprob_chunks or plan.pool_chunks else {}
        if plan.prompt_logprob_chunks:
            for rid, begin, entries in self.prompt_lps:
                r = by_id[rid]
                if begin == 0:  # the prompt's first chunk (again, after a preemption)
                    r.prompt_logprobs = []
                r.prompt_logprobs.extend(entries)
            self.prompt_lps = []
        self.pooled = []
        if plan.pool_chunks:
            self.pooled = pool_step(plan, self.pool_hidden, by_id, self.pooling_type)
            self.pool_hidden = None
        t3 = time.perf_counter()
        record.num_decodes = plan.num_decodes
        record.num_prefill_tokens = sum(p.length for p in plan.prefills)
        record.decode_context_tokens = int(plan.decode_seq_lens.sum())
        record.prepare, record.forward, record.sample = t1 - t0, t2 - t1, t3 - t2
        return sampling, out
