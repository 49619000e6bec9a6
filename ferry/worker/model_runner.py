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
from dataclasses import dataclass

import torch

from ferry.config import EngineArgs
from ferry.core.block_hash import lora_hash_key
from ferry.core.request import Request
from ferry.core.scheduler import SchedulerOutput
from ferry.distributed.parallel_state import SINGLE, SINGLE_STAGE, PipelineStage, TensorParallel
from ferry.distributed.pipeline_channel import PipelineChannel
from ferry.kv_quant import KEYS, ROWS, VALUES, copy_slots
from ferry.layers.attention import AttentionBackend, build_metadata
from ferry.layers.lora import LoRABatch, lora_batch
from ferry.layers.moe import triton_moe_available
from ferry.models.llama import LlamaForCausalLM
from ferry.models.lora_adapters import LoRAAdapter, attach, detach, read_peft_adapter
from ferry.utils import lazy_zeros
from ferry.worker.cpu_allocator import tune_cpu_allocator
from ferry.worker.cuda_graphs import CUDAGraphRunner
from ferry.worker.model_loading import LoadedModel, resolve_kv_cache_dtype
from ferry.worker.pooler import pool_step
from ferry.worker.prompt_logprobs import prompt_logprobs
from ferry.worker.sampler import Sampler, VerifiedOutput
from ferry.worker.step_plan import CollectStep, StepPlan, StepRecord, build_step_plan

logger = logging.getLogger(__name__)


@dataclass
class LoadedLoRA:
    """An adapter attached to the model: its slot, what its requests' block hashes mix in (its name
    and `digest`, core/block_hash.py), the digest of its files, and its directory."""

    slot: int
    key: str
    digest: str
    path: str


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class SubmittedStep:
    """A step whose forward is under way on the later pipeline stages; rank 0 samples it when its
    final hidden states come back (`ModelRunner.complete`)."""

    sched: SchedulerOutput
    plan: StepPlan
    sampling: list[Request]
    drafts: list[list[int]]
    record: StepRecord
    # Each scheduled request's preemption count when submitted: a request preempted (or finished)
    # since gets nothing from this step.
    preemptions: dict[str, int]

    def is_current(self, request: Request) -> bool:
        return not request.status.finished and request.num_preemptions == self.preemptions[request.request_id]


class ModelRunner:
    """Runs the model on this rank's shard over each step's plan; rank 0 also plans and samples.
    Under pipeline parallelism, this rank's stage: stage 0's ranks run the first layers and take the
    final hidden states back from the last stage (`submit` / `complete`), later stages run theirs on
    what the previous stage sends (`run_stage`)."""

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
        pp: PipelineStage = SINGLE_STAGE,
        channel: PipelineChannel | None = None,
    ) -> None:
        """`check_peers` (rank 0 under tensor or pipeline parallelism) raises if another rank's
        process is gone: a collective with it would block for ever. `channel`: what this rank's
        pipeline stage sends and receives through (pp.size > 1)."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.pp = pp
        self.channel = channel
        self.check_peers = check_peers
        if device.type == "cpu":
            tune_cpu_allocator()
        cfg = model.config
        self.cache_dtype = kv_cache_dtype or dtype
        self.num_kv_heads = model.layers[0].self_attn.num_kv_heads  # this rank's
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_cache_prefault = False  # --kv-cache-prefault: the CPU cache's pages faulted in ahead
        self.kv_populator: lazy_zeros.Populator | None = None  # its thread, while the cache lives
        self.sampler = Sampler(cfg.vocab_size)
        self.attn_backend: AttentionBackend = model.attention_backend(
            attention_backend, device, dtype, self.cache_dtype
        )
        # Every backend applies each layer's window; when every layer has one (Mistral), the blocks that
        # fall out of it are freed while a request runs (core/kv_cache_manager.py), not with a
        # local/global mix (Gemma), whose global layers read the whole context.
        self.sliding_window: int | None = None if cfg.full_attention_layers else cfg.sliding_window
        self.graphs: CUDAGraphRunner | None = None
        # LoRA adapters attached to the model (models/lora_adapters.py), by name.
        self.loras: dict[str, LoadedLoRA] = {}
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
        # Early exit's proposer (spec_decode/early_exit.py), when it drafts over this runner's cache:
        # the residual streams it left for a step's rows, which then run only the last layers.
        self.early_exit = None

    @classmethod
    def create(
        cls,
        args: EngineArgs,
        loaded: LoadedModel,
        tp: TensorParallel = SINGLE,
        check_peers: Callable[[], None] | None = None,
        pp: PipelineStage = SINGLE_STAGE,
        channel: PipelineChannel | None = None,
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
            pp=pp,
            channel=channel,
        )
        runner.pooling_type = args.pooling_type
        runner.kv_cache_prefault = args.kv_cache_prefault
        return runner

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Per layer, a (K, V) pair of [num_blocks, block_size, kv_heads, head_dim] tensors (head_dim + 4
        for a quantized cache: each row's fp32 scale follows its values); MLA's one latent tensor."""
        self.kv_caches = self.model.new_kv_cache(num_blocks, self.block_size, self.cache_dtype, self.device)

    def free_kv_cache(self) -> None:
        """Drop the cache and the CUDA graphs captured over it (their memory goes with them)."""
        if self.kv_populator is not None:
            self.kv_populator.stop()
            self.kv_populator = None
        self.kv_caches = []
        self.graphs = None

    def initialize_kv_cache(self, num_blocks: int, max_num_seqs: int, max_model_len: int, enforce_eager: bool) -> None:
        """Allocate the KV cache, then capture CUDA graphs for decode-only batches (on CUDA with
        the Triton backend, unless `enforce_eager`); every rank does this together. With
        `kv_cache_prefault` on the CPU, a background thread faults its pages in from now on."""
        self.allocate_kv_cache(num_blocks)
        if self.kv_cache_prefault and self.device.type == "cpu":
            unique = {t.data_ptr(): t for pair in self.kv_caches for t in pair}  # (MLA: one tensor twice)
            self.kv_populator = lazy_zeros.populate_in_background(list(unique.values()))
        if self.model.config.moe_layers and not enforce_eager and self.device.type == "cuda" \
                and not triton_moe_available():  # fmt: skip
            # The grouped experts size their GEMMs on the host (layers/moe.py): nothing to replay.
            logger.info("no CUDA graphs: mixture-of-experts layers group their tokens on the host without triton")
            enforce_eager = True
        if self.pp.size > 1 and not enforce_eager and self.device.type == "cuda":
            logger.info("no CUDA graphs: a pipeline stage's steps run eagerly")
            enforce_eager = True
        if not enforce_eager and self.device.type == "cuda" and self.attn_backend.name == "triton":
            self.graphs = CUDAGraphRunner(
                self.model, self.attn_backend, self.kv_caches, self.block_size, self.device, max_num_seqs, max_model_len
            )
            self.graphs.capture()

    def add_lora(self, adapter: LoRAAdapter, replace: bool = False) -> int:
        """Attach an adapter read from disk under the lowest free slot; its slot. ValueError (and the
        model unchanged) for one that does not fit this model or a name already taken (unless
        `replace`: the new version is attached first, then the old one's slot freed)."""
        old = self.loras.get(adapter.name)
        if old is not None and not replace:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        slot = min(set(range(len(self.loras) + 1)) - {lora.slot for lora in self.loras.values()})
        try:
            attach(self.model, slot, adapter)
        except BaseException:
            detach(self.model, slot)  # what an error past the checks (out of memory) left attached
            raise
        if old is not None:
            detach(self.model, old.slot)
        self.loras[adapter.name] = LoadedLoRA(slot, lora_hash_key(adapter.name, adapter.digest), adapter.digest,
                                              adapter.path)  # fmt: skip
        return slot

    def add_lora_modules(self, args: EngineArgs) -> None:
        """The adapters of --lora-modules, in their order: every tensor-parallel rank loads them so,
        and each gets the same slot on every rank."""
        for name, path in args.lora_adapters:
            self.add_lora(read_peft_adapter(name, path, args.max_lora_rank))
            logger.info("LoRA adapter %r loaded from %s", name, path)

    def remove_lora(self, name: str) -> None:
        """Detach an adapter; the caller makes sure no request still runs under it. (Its cached
        blocks stay unreachable to another adapter of that name: they are keyed by content too.)"""
        detach(self.model, self.loras.pop(name).slot)

    def lora_key(self, name: str) -> str | None:
        """The block-hash key of adapter `name` (None: not loaded)."""
        lora = self.loras.get(name)
        return lora.key if lora is not None else None

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor | None:
        """This rank's forward over the step; the logits of `plan.logits_rows` (all ranks)."""
        return self._outputs(plan, self._run_model(plan))

    @torch.inference_mode()
    def forward_stream(self, plan: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Early exit's draft pass (this runner's model is the target's first layers): the logits of
        `plan.logits_rows` and every row's residual stream after those layers, where the target's
        verification goes on from (`last_layers`)."""
        hidden, stream = self._run_model(plan, pre_norm=True)
        return self._outputs(plan, hidden), stream

    def _run_model(
        self,
        plan: StepPlan,
        intermediate: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        pre_norm: bool = False,
        model: LlamaForCausalLM | None = None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The model (this rank's stage of it) over the step: replayed from a CUDA graph when one fits.
        `model` and `kv_caches`: another view of the model over those layers' caches (early exit's
        last layers; never from a graph), `pre_norm` as `LlamaForCausalLM.forward` takes it."""
        plain = model is None and not pre_norm
        lora = LoRABatch.from_slots(plan.lora_slots, self.device) if plan.lora_slots is not None else None
        if plain and lora is None and self.graphs is not None and self.graphs.fits(plan):  # (graphs know no adapter)
            return self.graphs.run(plan)
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
        with lora_batch(lora):
            if model is None:
                return self.model(ids, positions, self.kv_caches, meta, intermediate, pre_norm)
            return model(ids, positions, kv_caches, meta, intermediate, pre_norm)

    def _outputs(self, plan: StepPlan, hidden: torch.Tensor) -> torch.Tensor | None:
        """From the final hidden states: the embedding rows kept for pooling, prompt logprobs, and the
        logits of `plan.logits_rows` (None when there are none)."""
        self.pool_hidden = hidden if plan.pool_chunks else None
        if plan.prompt_logprob_chunks:
            self.prompt_lps = prompt_logprobs(plan, hidden, self.model.compute_logits)
        if not len(plan.logits_rows):
            self.logits_hidden = None
            return None
        rows = torch.from_numpy(plan.logits_rows).to(self.device, non_blocking=True)
        self.logits_hidden = hidden.index_select(0, rows)
        return self.model.compute_logits(self.logits_hidden)

    @torch.inference_mode()
    def profile_forward(self, plan: StepPlan) -> torch.Tensor | None:
        """The memory profile's forward: this rank's stage alone (no other stage takes part), on zeros
        where the previous stage's activations would come in; stage 0 also computes logits, of zeros."""
        if self.pp.size == 1:
            return self.forward(plan)
        T, h = len(plan.input_ids), self.model.config.hidden_size
        zeros = torch.zeros(T, h, dtype=self.dtype, device=self.device)
        self._run_model(plan, None if self.pp.is_first else (zeros, zeros.clone()))
        return self._outputs(plan, zeros) if self.pp.is_first else None

    # -- pipeline parallelism ------------------------------------------

    @torch.inference_mode()
    def run_first_stage(self, plan: StepPlan) -> None:
        """Stage 0: the embedding and the first layers, handed on to stage 1 with the plan."""
        x, residual = self._run_model(plan)
        self.channel.send(self.pp.next_rank, plan, (x, residual))

    @torch.inference_mode()
    def run_stage(self, plan: StepPlan) -> None:
        """A later stage: its layers over what the previous stage sent; the last stage sends the
        final hidden states back to stage 0, the others hand on to the next stage."""
        T, h = len(plan.input_ids), self.model.config.hidden_size
        x, residual = self.channel.recv_tensors(self.pp.prev_rank, [(T, h), (T, h)], self.dtype)
        out = self._run_model(plan, (x, residual))
        if self.pp.is_last:
            self.channel.send(self.pp.next_rank, None, (out,))
        else:
            self.channel.send(self.pp.next_rank, plan, out)

    @torch.inference_mode()
    def collect(self, plan: StepPlan) -> torch.Tensor | None:
        """Stage 0: the final hidden states of the oldest step in flight, back from the last stage;
        its logits (and pooled rows, prompt logprobs)."""
        T, h = len(plan.input_ids), self.model.config.hidden_size
        (hidden,) = self.channel.recv_tensors(self.pp.prev_rank, [(T, h)], self.dtype)
        return self._outputs(plan, hidden)

    def submit(self, sched: SchedulerOutput, record: StepRecord) -> SubmittedStep:
        """Rank 0 under pipeline parallelism: plan the step and run stage 0 of it; the later stages
        take it from there while rank 0 goes on to the next micro-batch. `complete` samples it."""
        t0 = time.perf_counter()
        plan, sampling, drafts = build_step_plan(sched, self.block_size)
        self._broadcast(plan)
        t1 = time.perf_counter()
        self.run_first_stage(plan)
        record.prepare, record.forward = t1 - t0, time.perf_counter() - t1
        preemptions = {r.request_id: r.num_preemptions for r, _ in sched.scheduled}
        return SubmittedStep(sched, plan, sampling, drafts, record, preemptions)

    def complete(self, step: SubmittedStep) -> tuple[list[Request], VerifiedOutput | None]:
        """Rank 0: wait for a submitted step's final hidden states and sample it. Requests preempted,
        aborted or finished since it was submitted get nothing from it."""
        t0 = time.perf_counter()
        self._broadcast(CollectStep())
        logits = self.collect(step.plan)
        t1 = time.perf_counter()
        current = [i for i, r in enumerate(step.sampling) if step.is_current(r)]
        sampling = [step.sampling[i] for i in current]
        drafts = [step.drafts[i] for i in current]
        if logits is not None and len(current) < len(step.sampling):
            # One logits row per sampling request: nothing is speculated under pipeline parallelism.
            logits = logits.index_select(0, torch.tensor(current, dtype=torch.long, device=logits.device))
        out = self._sample_and_attach(step.sched, step.plan, sampling, drafts, logits if sampling else None,
                                      step.is_current)  # fmt: skip
        step.record.forward += t1 - t0
        step.record.sample = time.perf_counter() - t1
        self._fill_record(step.record, step.plan)
        return sampling, out

    def _broadcast(self, msg: StepPlan | CollectStep) -> None:
        """Hand this step's message to the other tensor-parallel ranks of this stage."""
        if self.tp.size > 1:
            if self.check_peers is not None:
                self.check_peers()
            self.tp.broadcast_object(msg)

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
            if k_cache is v_cache:  # MLA's latent cache, read as both
                copy_slots(k_cache, src_t, dst_t, ROWS)
            else:
                copy_slots(k_cache, src_t, dst_t, KEYS)
                copy_slots(v_cache, src_t, dst_t, VALUES)

    def execute(self, sched: SchedulerOutput, record: StepRecord) -> tuple[list[Request], VerifiedOutput | None]:
        """Run one step (rank 0): plan -> forward (every rank) -> sample (and verify drafts);
        returns the requests that got new tokens and, per request, the tokens it keeps."""
        streams = self.early_exit.streams_for(sched) if self.early_exit is not None else {}
        if streams:
            return self._execute_from_streams(sched, record, streams)
        t0 = time.perf_counter()
        plan, sampling, drafts = build_step_plan(sched, self.block_size)
        self._broadcast(plan)
        if self.profile:
            _sync(self.device)
        t1 = time.perf_counter()
        logits = self.forward(plan)
        if self.profile:
            _sync(self.device)
        t2 = time.perf_counter()
        out = self._sample_and_attach(sched, plan, sampling, drafts, logits)
        record.prepare, record.forward, record.sample = t1 - t0, t2 - t1, time.perf_counter() - t2
        self._fill_record(record, plan)
        return sampling, out

    @torch.inference_mode()
    def _execute_from_streams(
        self, sched: SchedulerOutput, record: StepRecord, streams: dict[str, torch.Tensor]
    ) -> tuple[list[Request], VerifiedOutput | None]:
        """A step some of whose requests early exit drafted for: their rows (the last token and the
        drafts, whose first layers' K/V the draft wrote) run only the last layers, from the residual
        streams it left; the step's other requests run the whole model, as a forward of their own.
        Both halves' logits are then sampled and verified together.

        The last layers run first: a prompt in the other half may share (as a prefix-cache hit
        published when this step was scheduled) the block that a drafting request's last token
        fills, and must find that token's K/V in every layer when it attends. The rows here only
        read their own requests' blocks, which the other half never writes."""
        t0 = time.perf_counter()
        rest, whole = SchedulerOutput(), SchedulerOutput()
        for request, n in sched.scheduled:
            part = rest if request.request_id in streams else whole
            part.scheduled.append((request, n))
            rid = request.request_id
            part.block_ids[rid] = sched.block_ids[rid]
            if rid in sched.spec_token_ids:
                part.spec_token_ids[rid] = sched.spec_token_ids[rid]
        # (No tree: early exit drafts one chain per request.)
        plan_r, sampling_r, drafts_r = build_step_plan(rest, self.block_size)
        plan_w, sampling_w, drafts_w = build_step_plan(whole, self.block_size) if whole.scheduled else (None, [], [])
        stream = torch.cat([streams[r.request_id] for r, _ in rest.scheduled])  # decode rows, in this order
        if self.profile:
            _sync(self.device)
        t1 = time.perf_counter()
        ee = self.early_exit
        out_r = self._run_model(plan_r, (stream, None), model=ee.rest, kv_caches=self.kv_caches[ee.num_layers :])
        rows = torch.from_numpy(plan_r.logits_rows).to(self.device, non_blocking=True)
        hidden = [out_r.index_select(0, rows)]
        logits = [self.model.compute_logits(hidden[0])]
        if plan_w is not None:
            logits_w = self._outputs(plan_w, self._run_model(plan_w))  # (sets logits_hidden, pooling, prompt logprobs)
            if logits_w is not None:
                logits.append(logits_w)
                hidden.append(self.logits_hidden)
        else:
            self.pool_hidden, self.prompt_lps = None, []
        self.logits_hidden = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
        if self.profile:
            _sync(self.device)
        t2 = time.perf_counter()
        sampling, drafts = sampling_r + sampling_w, drafts_r + drafts_w
        logits_all = torch.cat(logits) if len(logits) > 1 else logits[0]
        out = self._sample_and_attach(sched, plan_w or plan_r, sampling, drafts, logits_all)
        record.prepare, record.forward, record.sample = t1 - t0, t2 - t1, time.perf_counter() - t2
        self._fill_record(record, *(plan for plan in (plan_r, plan_w) if plan is not None))
        record.num_stream_rows = plan_r.num_decodes
        return sampling, out

    def _sample_and_attach(
        self,
        sched: SchedulerOutput,
        plan: StepPlan,
        sampling: list[Request],
        drafts: list[list[int]],
        logits: torch.Tensor | None,
        is_current: Callable[[Request], bool] | None = None,
    ) -> VerifiedOutput | None:
        """Sample (and verify drafts) from the step's logits; attach its prompt logprobs and pooled
        embeddings to their requests (only to those `is_current` accepts)."""
        # A request without drafts is verified with none: its one row's draw is its token.
        out = None
        if logits is not None:
            parents = [sched.spec_parents.get(r.request_id) for r in sampling] if sched.spec_parents else None
            out = self.sampler.verify(logits, sampling, drafts, parents)
            if parents:
                self._move_kept_drafts(sched, sampling, out.kept_nodes)
        self._sampled, self._sampled_rows = (sampling, out.last_rows) if out is not None else ([], [])
        by_id = {}
        if plan.prompt_logprob_chunks or plan.pool_chunks:
            by_id = {r.request_id: r for r, _ in sched.scheduled if is_current is None or is_current(r)}
        if plan.prompt_logprob_chunks:
            for rid, begin, entries in self.prompt_lps:
                r = by_id.get(rid)
                if r is None:
                    continue
                if begin == 0:  # the prompt's first chunk (again, after a preemption)
                    r.prompt_logprobs = []
                r.prompt_logprobs.extend(entries)
            self.prompt_lps = []
        self.pooled = []
        if plan.pool_chunks:
            self.pooled = pool_step(plan, self.pool_hidden, by_id, self.pooling_type)
            self.pool_hidden = None
        return out

    @staticmethod
    def _fill_record(record: StepRecord, *plans: StepPlan) -> None:
        """The step's shape: over every forward it ran (early exit's verify runs two)."""
        record.num_decodes = sum(plan.num_decodes for plan in plans)
        record.num_prefill_tokens = sum(p.length for plan in plans for p in plan.prefills)
        record.decode_context_tokens = sum(int(plan.decode_seq_lens.sum()) for plan in plans)
