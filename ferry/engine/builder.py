"""Build an EngineCore from EngineArgs: the model (or a loaded one), tensor-parallel ranks, the
model runner, KV-cache sizing, the scheduler.

One place for what `LLMEngine`, the EngineCore process and the benchmarks all need, so none of
them constructs another's front half to get a core.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time

import torch

from ferry.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.scheduler import Scheduler
from ferry.distributed.parallel_state import SINGLE, SINGLE_STAGE, TensorParallel
from ferry.engine.core import EngineCore
from ferry.engine.messages import EngineInfo
from ferry.models.config import ModelConfig
from ferry.models.cpu_decode_step import CPUDecodeStep
from ferry.models.gguf_file import GGUFFile
from ferry.tokenizer import backend_tokenizer_from_files, eos_token_id_from_files, has_tokenizer, load_tokenizer
from ferry.utils.math import cdiv
from ferry.utils.process import freeze_startup_heap
from ferry.worker.memory import blocks_in_budget, gpu_kv_budget, host_kv_budget, kv_bytes_per_block
from ferry.worker.model_loading import LoadedModel, load_model
from ferry.worker.model_runner import ModelRunner
from ferry.worker.spec_decode import DraftProposer
from ferry.worker.spec_decode.draft_model import DraftModelProposer, check_same_vocabulary
from ferry.worker.spec_decode.early_exit import EarlyExitProposer
from ferry.worker.spec_decode.medusa import MedusaHeads, MedusaProposer
from ferry.worker.tp_worker import TensorParallelWorkers

logger = logging.getLogger(__name__)


def build_engine_core(
    args: EngineArgs,
    loaded: LoadedModel | None = None,
    draft: LoadedModel | None = None,
    *,
    tokenizer: bool = True,
    freeze_heap: bool | None = None,
) -> EngineCore:
    """Load the model (unless `loaded` is given: tests share one) and any draft model (unless
    `draft` is given), start the other tensor- and pipeline-parallel ranks, size and allocate the KV
    caches, and return the core, ready to step.

    `tokenizer=False` (an engine core process, whose API process tokenizes): the model's tokenizer is
    not loaded at start (~1 s of a 5 s start, transformers' import most of it); its EOS id is read from
    its files and structured output loads it when a request first needs it. A draft checkpoint's
    vocabulary is compared with it, so speculative decoding with one loads it at start.

    `freeze_heap`: collect and freeze the heap once built (utils/process.py freeze_startup_heap). By
    default only an engine that loads its own model, as a server's core or `LLM` does: one built over
    a `loaded` model shares a process that builds engines again and again (tests, benchmarks), where
    each full collection walked that whole heap (0.2 s an engine here, 78 engines in one test file)."""
    tp_workers: TensorParallelWorkers | None = None
    tp, pp = SINGLE, SINGLE_STAGE
    if args.world_size > 1:
        if loaded is not None:
            raise ValueError("tensor/pipeline parallelism loads the model in every rank; do not pass a loaded model")
        tp_workers = TensorParallelWorkers(args)  # ranks 1..N-1 load their shards meanwhile
        atexit.register(tp_workers.shutdown)  # LLM users rarely shut down; tear the group down cleanly
        tp, pp = tp_workers.tp, tp_workers.pp
    if freeze_heap is None:
        freeze_heap = loaded is None
    try:
        t0 = time.perf_counter()
        defer_tokenizer = not tokenizer and loaded is None and not _has_draft_checkpoint(args)
        loaded = loaded or load_model(args, tp, pp, tokenizer=not defer_tokenizer)
        tokenizer_loader = None
        if defer_tokenizer and loaded.tokenizer is None:  # (int8 calibration loads it all the same)
            loaded, tokenizer_loader = _deferred_tokenizer(args, loaded)
        t1 = time.perf_counter()
        core = _build(args, loaded, tp, tp_workers, draft, tokenizer_loader)
        core.info.startup_seconds.update(load_weights=t1 - t0, kv_cache=time.perf_counter() - t1)
        if freeze_heap:
            freeze_startup_heap()
        return core
    except BaseException:
        if tp_workers is not None:
            tp_workers.shutdown()
        raise


def _build(
    args: EngineArgs,
    loaded: LoadedModel,
    tp: TensorParallel,
    tp_workers: TensorParallelWorkers | None,
    draft: LoadedModel | None,
    tokenizer_loader: _TokenizerLoader | None,
):
    cfg: ModelConfig = loaded.model.config
    cfg.check_max_model_len(args.max_model_len)  # (again: `loaded` may have been loaded for another engine)
    context = args.max_model_len or cfg.context_length
    if (not args.enable_chunked_prefill and args.max_num_batched_tokens < context
            and args.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS):  # fmt: skip
        # Unset, without chunked prefill: a whole prompt a step (the model's context was not known when
        # the arguments were read). Before anything is sized: the KV budget keeps room for such a step.
        args = dataclasses.replace(args, max_num_batched_tokens=context)
    torch.manual_seed(args.seed)
    draft = _load_draft(args, loaded, tp, draft)  # before sizing the KV cache: its weights take memory
    runner = ModelRunner.create(args, loaded, tp, check_peers=tp_workers.check_alive if tp_workers else None,
                                pp=tp_workers.pp if tp_workers else SINGLE_STAGE,
                                channel=tp_workers.channel if tp_workers else None)  # fmt: skip
    runner.add_lora_modules(args)  # before sizing the KV cache: their weights take memory (the other ranks' too)
    bs = args.block_size
    # Of the largest pipeline stage: every stage allocates as many blocks as rank 0's budget allows it.
    stage_layers = max((b - a for a, b in tp_workers.layer_ranges), default=None) if tp_workers else None
    block_bytes = kv_bytes_per_block(cfg, bs, runner.cache_dtype, tp.size, stage_layers)
    draft_runner = ModelRunner.create(args, draft) if draft is not None else None
    early_exit = args.speculative is not None and args.speculative.method == "early_exit"
    if draft_runner is not None and not early_exit:  # the draft's cache has as many blocks as the target's
        block_bytes += kv_bytes_per_block(draft.model.config, bs, draft_runner.cache_dtype, 1)
    num_blocks = args.num_kv_blocks or _num_kv_blocks(args, runner, tp_workers, block_bytes)
    max_len = _max_model_len(args, cfg, num_blocks, runner.sliding_window)
    eos_token_ids = set(cfg.eos_token_ids)
    tokenizer_eos = loaded.tokenizer.eos_token_id if loaded.tokenizer is not None else None
    if tokenizer_loader is not None:
        tokenizer_eos = tokenizer_loader.eos_token_id
    if tokenizer_eos is not None:
        eos_token_ids.add(tokenizer_eos)

    kv = KVCacheManager(num_blocks, bs, args.enable_prefix_caching, sliding_window=runner.sliding_window)
    scheduler = Scheduler(
        kv,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_loras=args.max_loras if args.enable_lora else None,
    )
    if not args.enable_chunked_prefill and args.max_num_batched_tokens < max_len:
        raise ValueError(
            f"without chunked prefill, max_num_batched_tokens ({args.max_num_batched_tokens}) "
            f"must be >= max_model_len ({max_len})"
        )
    if tp_workers is not None:
        tp_workers.initialize_kv_cache(runner, num_blocks, args.max_num_seqs, max_len)
    else:
        runner.initialize_kv_cache(num_blocks, args.max_num_seqs, max_len, args.enforce_eager)
    if draft_runner is not None and not early_exit:  # (early exit drafts over the target's cache)
        draft_runner.initialize_kv_cache(num_blocks, args.max_num_seqs, max_len, args.enforce_eager)
    info = EngineInfo(
        model_path=str(args.model or ""),
        max_model_len=max_len,
        vocab_size=cfg.vocab_size,
        eos_token_ids=sorted(eos_token_ids),
        block_size=bs,
        num_kv_blocks=num_blocks,
        max_logprobs=cfg.vocab_size if args.max_logprobs == -1 else min(args.max_logprobs, cfg.vocab_size),
        lora_digests={name: lora.digest for name, lora in runner.loras.items()},
    )
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, bs, num_blocks * block_bytes / 2**30)
    proposer = None
    if args.speculative is not None:
        drafter = None
        if early_exit:
            drafter = EarlyExitProposer(draft_runner, runner, kv)
            if runner.model.cpu_decode_step is not None:
                drafter.rest.cpu_decode_step = CPUDecodeStep.build(drafter.rest)
            runner.early_exit = drafter
        elif draft_runner is not None:
            draft_kv = KVCacheManager(num_blocks, bs, args.enable_prefix_caching)
            drafter = DraftModelProposer(draft_runner, draft_kv, cfg.vocab_size, args.max_num_batched_tokens)
        medusa = _medusa_proposer(args, runner, tp, max_len) if args.speculative.method == "medusa" else None
        proposer = DraftProposer(args.speculative, max_len, drafter, medusa, seed=args.seed)
    lora_limits = (args.max_lora_rank, args.max_loaded_loras) if args.enable_lora else None
    return EngineCore(scheduler, runner, eos_token_ids, info=info, tokenizer=loaded.tokenizer,
                      load_tokenizer=tokenizer_loader, tp_workers=tp_workers, proposer=proposer,
                      embed_max_batch=args.embed_max_batch,
                      embed_max_delay=args.embed_max_delay_ms / 1000, lora_limits=lora_limits)  # fmt: skip


class _TokenizerLoader:
    """The tokenizer of a core that loaded none at start, loaded when structured output first calls (in
    the grammar compiler's thread), once: read from tokenizer.json where that is what transformers
    would run (tokenizers' Rust: ~0.2 s, no transformers import: its ~1 s of Python would hold the GIL
    the core's steps need meanwhile), else by transformers. `eos_token_id`: read at start."""

    def __init__(self, path: str, trust_remote_code: bool, eos_token_id: int | None) -> None:
        self.path, self.trust_remote_code, self.eos_token_id = path, trust_remote_code, eos_token_id
        self._lock = threading.Lock()
        self._tokenizer = None
        self._error: Exception | None = None  # a load that failed fails every later call at once

    def __call__(self):
        with self._lock:
            if self._error is not None:
                raise ValueError(f"the model's tokenizer did not load: {self._error}")
            if self._tokenizer is None:
                try:
                    self._tokenizer = backend_tokenizer_from_files(self.path)
                except LookupError as e:
                    logger.info("loading the tokenizer with transformers: %s", e)
                    try:
                        self._tokenizer = load_tokenizer(self.path, self.trust_remote_code)
                    except Exception as error:
                        self._error = error
                        logger.exception("the tokenizer of %s did not load", self.path)
                        raise ValueError(f"the model's tokenizer did not load: {error}") from error
            return self._tokenizer


def _deferred_tokenizer(args: EngineArgs, loaded: LoadedModel) -> tuple[LoadedModel, _TokenizerLoader | None]:
    """For a core that loaded no tokenizer: a loader for structured output that knows the tokenizer's EOS
    id (None: the model has no tokenizer), or, where the EOS id needs the tokenizer loaded (neither a
    GGUF's metadata nor eos_token_id_from_files tells it), `loaded` with the tokenizer, loaded now."""
    path = args.tokenizer or loaded.path
    if not path or not has_tokenizer(path):
        return loaded, None
    try:
        if path.endswith(".gguf"):  # transformers converts it with its metadata's EOS id
            eos = GGUFFile(path).fields.get("tokenizer.ggml.eos_token_id")
            if eos is None:
                raise LookupError(f"{path} has no tokenizer.ggml.eos_token_id")
            eos = int(eos.contents())
        else:
            eos = eos_token_id_from_files(path)
    except LookupError as e:
        logger.info("loading the tokenizer at start: its EOS token needs it (%s)", e)
        return loaded._replace(tokenizer=load_tokenizer(path, args.trust_remote_code)), None
    return loaded, _TokenizerLoader(path, args.trust_remote_code, eos)


def _has_draft_checkpoint(args: EngineArgs) -> bool:
    """A speculative method that loads a draft model: check_same_vocabulary compares the tokenizers."""
    return args.speculative is not None and args.speculative.method == "draft_model"


def _load_draft(args: EngineArgs, loaded: LoadedModel, tp: TensorParallel, draft: LoadedModel | None):
    """The model that drafts for the draft_model and early_exit methods (None for ngram): the
    draft checkpoint, loaded (unless given) on the target's device in its dtype, or a view of the
    target's first layers."""
    spec = args.speculative
    if spec is None or spec.method in ("ngram", "medusa"):
        return None
    if tp.size > 1:
        raise ValueError(f"speculative method {spec.method} does not run under tensor parallelism yet")
    if spec.method == "early_exit":
        view = loaded.model.first_layers(spec.draft_layers)
        if loaded.model.cpu_decode_step is not None:
            view.cpu_decode_step = CPUDecodeStep.build(view)
        return loaded._replace(model=view)
    if draft is None:
        draft_args = EngineArgs(
            model=spec.model,
            device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            seed=args.seed,
            # the target's context: the draft's rotary tables reach every position it drafts at
            max_model_len=args.max_model_len or loaded.model.config.context_length,
            load_format=args.load_format,
            enforce_eager=args.enforce_eager,
        )
        draft = load_model(draft_args, draft=True)
    check_same_vocabulary(loaded, draft)
    return draft


def _medusa_proposer(args: EngineArgs, runner: ModelRunner, tp: TensorParallel, max_len: int) -> MedusaProposer:
    """The Medusa heads of `--speculative-config`'s `model`, on the target's device and in its dtype."""
    spec = args.speculative
    if tp.size > 1:
        raise ValueError("speculative method medusa does not run under tensor parallelism yet")
    cfg = runner.model.config
    heads = MedusaHeads.load(spec.model, cfg.hidden_size, cfg.vocab_size)
    if spec.num_speculative_tokens > heads.num_heads:
        raise ValueError(
            f"num_speculative_tokens ({spec.num_speculative_tokens}) exceeds the {heads.num_heads} Medusa heads "
            f"in {spec.model!r}: each head drafts one token"
        )
    if spec.speculative_token_tree is not None and not getattr(runner.attn_backend, "supports_tree", False):
        logger.warning("the %s attention backend cannot verify trees: each Medusa head drafts its first guess only",
                       runner.attn_backend.name)  # fmt: skip
    heads = heads.to(runner.device, runner.dtype).eval()
    return MedusaProposer(heads, runner, max_len, spec.speculative_token_tree)


def _num_kv_blocks(args: EngineArgs, runner: ModelRunner, tp_workers: TensorParallelWorkers | None,
                   block_bytes: int) -> int:  # fmt: skip
    """Blocks of `block_bytes` in the host budget, or, on CUDA, the fewest any rank's GPU can hold."""
    if args.kv_cache_memory_bytes is not None or runner.device.type != "cuda":
        return blocks_in_budget(host_kv_budget(args), block_bytes)
    if tp_workers is not None:  # (no draft model under tensor or pipeline parallelism)
        return tp_workers.gpu_kv_blocks(runner)
    return blocks_in_budget(gpu_kv_budget(runner, args), block_bytes)  # block_bytes: with the draft's


def _max_model_len(args: EngineArgs, cfg: ModelConfig, num_blocks: int, window: int | None) -> int:
    """The model's context (or --max-model-len), capped to what this engine can hold: a lone
    request always fits, so the scheduler always makes progress. `window`: the sliding window of
    every layer, whose blocks are freed as they fall out of it (its requests hold about a window
    of blocks, whatever their length)."""
    capacity = num_blocks * args.block_size
    max_len = args.max_model_len or cfg.context_length
    if window is not None:
        # A request holds at most the window before a step's first token plus the step's tokens (and a
        # partial block at each end) at once, whatever its length.
        if cdiv(window + args.max_num_batched_tokens, args.block_size) + 2 <= num_blocks:
            return max_len
    if max_len > capacity:
        if args.max_model_len is not None:
            raise ValueError(
                f"max_model_len {args.max_model_len} needs {cdiv(args.max_model_len, args.block_size)} KV blocks, "
                f"but the KV cache has {num_blocks}; raise num_kv_blocks / kv_cache_memory_bytes "
                "or lower max_model_len"
            )
        logger.warning("KV cache holds %d tokens; capping max_model_len from %d", capacity, max_len)
        max_len = capacity
    return max_len
