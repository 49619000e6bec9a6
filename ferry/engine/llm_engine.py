"""LLMEngine: the step API (add_request / abort_request / step) over EngineCore + OutputProcessor."""

from __future__ import annotations

import atexit
import logging
import time
from typing import Any

import torch

from ferry.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs
from ferry.distributed.parallel_state import SINGLE, TensorParallel
from ferry.distributed.tp_worker import TensorParallelWorkers
from ferry.core.block_hash import hash_prompt_blocks
from ferry.engine.core import EngineCore
from ferry.engine.input_processor import InputProcessor, PromptType
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.utils.math import cdiv
from ferry.engine.kv_transfer import KVBlocks, export_blocks, import_blocks
from ferry.engine.messages import EngineInfo, EngineStats
from ferry.engine.model_runner import ModelRunner
from ferry.engine.output_processor import OutputProcessor
from ferry.core.scheduler import Scheduler
from ferry.kernels.cpu import cpu_kernels_enabled
from ferry.layers.int8_linear import int8_linear_available
from ferry.layers.linear import should_pack
from ferry.layers.smoothquant import calibration_token_ids
from ferry.models.config import ModelConfig
from ferry.models.llama import LlamaForCausalLM
from ferry.models.loader import load_checkpoint
from ferry.outputs import RequestOutput
from ferry.sampling_params import SamplingParams
from ferry.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Kept free for the CUDA graphs' memory pool (decode activations of the largest batch).
CUDA_GRAPH_RESERVE_BYTES = 1 << 30


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls are ~2x slower than fp32 on CPUs without AMX
    return torch.bfloat16 if cfg.dtype in ("float32", "bfloat16") else getattr(torch, cfg.dtype)


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Reject a quantization this device/dtype cannot run, before any weight is loaded."""
    if method != "int8":
        return
    if device.type != "cpu":
        raise ValueError("--quantization int8 runs on the CPU only (oneDNN's int8 GEMM)")
    if dtype != torch.float32:
        raise ValueError(f"--quantization int8 needs --dtype float32 (activations are fp32), got {dtype}")
    if not int8_linear_available():
        raise ValueError("--quantization int8: this torch build lacks oneDNN's int8 linear ops")


def load_model(
    args: EngineArgs, tp: TensorParallel = SINGLE
) -> tuple[LlamaForCausalLM, Any, torch.device, torch.dtype, str]:
    """Build our model (this rank's shard) from the checkpoint and load its tokenizer
    (separate so tests can share them)."""
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.model, args.load_format, args.seed)
    device = resolve_device(args.device)
    if device.type == "cuda" and tp.size > 1:
        device = torch.device("cuda", tp.rank)
    dtype = resolve_dtype(args.dtype, device, ckpt.config)
    check_quantization(args.quantization, device, dtype)
    if args.quantization and tp.size > 1:
        raise ValueError("--quantization int8 does not support --tensor-parallel-size > 1 yet")
    max_len = args.max_model_len or ckpt.config.max_position_embeddings
    with torch.device("meta"):
        model = LlamaForCausalLM(ckpt.config, max(max_len, ckpt.config.max_position_embeddings), tp)
    # Allocated in the target dtype (loaded tensors are cast as they are copied in): no fp32
    # copy of the whole model on the device, which the allocator would keep from the KV cache.
    model = model.to(dtype).to_empty(device=device)
    model.load_weights(ckpt.iter_weights(device))  # dummy weights are generated on the device
    model.init_rotary()  # to_empty left the tables uninitialised; they stay fp32
    model.eval()
    tokenizer = load_tokenizer(args.tokenizer or ckpt.path)
    if args.quantization == "int8":
        model.quantize_linear_weights_int8(calibration_token_ids(tokenizer, ckpt.config.vocab_size))
    elif should_pack(device, dtype) and cpu_kernels_enabled():
        model.pack_linear_weights()
    quant = f", {args.quantization} weights" if args.quantization else ""
    logger.info("loaded %s (%s%s) in %.1fs", ckpt.path, dtype, quant, time.perf_counter() - t0)
    return model, tokenizer, device, dtype, ckpt.path


def gpu_kv_budget(runner: ModelRunner, args: EngineArgs) -> int:
    """This rank's KV-cache bytes: gpu_memory_utilization x total, minus what others hold on the
    GPU, minus the engine's peak without a KV cache (weights + activations of a full prefill
    step + sampling, measured by a profiling forward), minus room for the CUDA graphs' pool."""
    device = runner.device
    num_tokens = args.max_num_batched_tokens
    # Positions of the profiled chunks stay inside the model's context (and its rotary tables).
    chunk = min(num_tokens, args.max_model_len or runner.model.config.max_position_embeddings)
    peak = runner.profile_peak_memory(num_tokens, chunk, args.max_num_seqs)
    # After the profile: NCCL, cuBLAS and Triton set up their (non-torch) memory during it.
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    others = (total - free) - torch.cuda.memory_reserved(device)
    graphs = 0 if args.enforce_eager or runner.attn_backend.name != "triton" else CUDA_GRAPH_RESERVE_BYTES
    budget = int(total * args.gpu_memory_utilization) - others - peak - graphs
    logger.info("GPU %s: %.1f GiB total, %.2f GiB others, %.2f GiB peak without KV cache -> %.2f GiB KV", device,
                total / 2**30, others / 2**30, peak / 2**30, budget / 2**30)  # fmt: skip
    return budget


class LLMEngine:
    def __init__(self, args: EngineArgs, *, model=None, tokenizer=None, device=None, dtype=None) -> None:
        """Build an engine; pass an already loaded `model` (with tokenizer, device, dtype) to reuse it."""
        self.args = args
        self.tp_workers: TensorParallelWorkers | None = None
        tp = SINGLE
        if args.tensor_parallel_size > 1:
            if model is not None:
                raise ValueError("tensor parallelism loads the model in every rank; do not pass a loaded model")
            self.tp_workers = TensorParallelWorkers(args)  # ranks 1..N-1 load their shards meanwhile
            atexit.register(self.shutdown)  # LLM users rarely call it; tear the group down cleanly
            tp = self.tp_workers.tp
        try:
            self._init(args, model, tokenizer, device, dtype, tp)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, args: EngineArgs, model, tokenizer, device, dtype, tp: TensorParallel) -> None:
        if model is None:
            model, tokenizer, device, dtype, _ = load_model(args, tp)
        self.model, self.tokenizer, self.device, self.dtype = model, tokenizer, device, dtype
        cfg: ModelConfig = model.config
        self.model_config = cfg
        torch.manual_seed(args.seed)

        bs = args.block_size
        self.kv_cache_dtype = dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
        self.runner = ModelRunner(model, None, bs, device, dtype, self.kv_cache_dtype, args.attention_backend, tp)
        block_bytes = ModelRunner.kv_bytes_per_block(cfg, bs, self.kv_cache_dtype, tp.size)
        num_blocks = args.num_kv_blocks or self._blocks_from_budget(block_bytes)
        capacity = num_blocks * bs
        max_len = args.max_model_len or cfg.max_position_embeddings
        if cfg.sliding_window is not None and cfg.sliding_window < max_len:
            logger.warning(
                "sliding-window attention is not implemented; capping max_model_len to %d", cfg.sliding_window
            )
            max_len = cfg.sliding_window
        if max_len > capacity:
            if args.max_model_len is not None:
                raise ValueError(
                    f"max_model_len {args.max_model_len} needs {cdiv(args.max_model_len, bs)} KV blocks, "
                    f"but the KV cache has {num_blocks}; raise num_kv_blocks / kv_cache_memory_bytes "
                    "or lower max_model_len"
                )
            logger.warning("KV cache holds %d tokens; capping max_model_len from %d", capacity, max_len)
            max_len = capacity
        self.max_model_len = max_len
        self.eos_token_ids = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)

        self.kv = KVCacheManager(num_blocks, bs, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
        )
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < max_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({args.max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_len})"
            )
        if self.tp_workers is not None:
            self.tp_workers.broadcast(("init", num_blocks, args.max_num_seqs, max_len))
            self.runner.check_peers = self.tp_workers.check_alive
        self.runner.kv = self.kv
        self.runner.allocate_kv_cache(num_blocks)
        if not args.enforce_eager:
            self.runner.capture_cuda_graphs(args.max_num_seqs, max_len)
        self.core = EngineCore(self.scheduler, self.runner, self.kv, self.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer)
        self.info = EngineInfo(
            model_path=str(getattr(args, "model", None) or ""),
            max_model_len=max_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            block_size=bs,
            num_kv_blocks=num_blocks,
        )
        self.input_processor = InputProcessor(tokenizer, self.info)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, bs, num_blocks * block_bytes / 2**30)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def _blocks_from_budget(self, block_bytes: int) -> int:
        if self.args.kv_cache_memory_bytes is not None:
            budget = self.args.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._gpu_kv_budget()
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        blocks = budget // block_bytes
        if blocks < 1:
            raise ValueError(f"KV-cache budget {budget} bytes is smaller than one block ({block_bytes} bytes)")
        return int(blocks)

    def _gpu_kv_budget(self) -> int:
        """Every rank measures its own GPU (see gpu_kv_budget); all use the smallest budget,
        since the block tables are shared."""
        if self.tp_workers is None:
            return gpu_kv_budget(self.runner, self.args)
        self.tp_workers.broadcast(("profile",))
        return self.tp_workers.tp.min_across_ranks(gpu_kv_budget(self.runner, self.args))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
            self.tp_workers = None

    # -- requests ---------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field, changing nothing."""
        in_use = self.output_processor.requests.keys() | self.scheduler.requests.keys()
        req = self.input_processor.process(
            request_id, prompt, params or SamplingParams(), priority=priority, arrival_time=arrival_time, in_use=in_use
        )
        self.output_processor.add_request(request_id, req.prompt, req.prompt_token_ids, req.params, req.seq_ids)
        for core_request in req.core_requests:
            self.core.add_request(core_request)

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.core.abort_requests(self.output_processor.seq_ids(rid))
            self.output_processor.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; returns outputs of the requests that progressed."""
        core_outputs = self.core.step()
        outputs, to_abort = self.output_processor.process(core_outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def export_kv(self, prompt_token_ids: list[int], skip: set[bytes] | frozenset = frozenset()) -> KVBlocks:
        """The KV blocks this engine still caches for a prompt's full blocks (after its prefill),
        without the leading ones in `skip` (engine/kv_transfer.py)."""
        if self.tp_workers is not None:
            raise ValueError("KV export does not support tensor parallelism yet")
        hashes = hash_prompt_blocks(prompt_token_ids, self.args.block_size)
        return export_blocks(self.kv, self.runner.kv_caches, hashes, skip)

    def import_kv(self, blocks: KVBlocks) -> int:
        """Publish another engine's blocks in this prefix cache; returns how many were new."""
        if self.tp_workers is not None:
            raise ValueError("KV import does not support tensor parallelism yet")
        return import_blocks(self.kv, self.runner.kv_caches, blocks)

    def get_stats(self) -> EngineStats:
        return self.core.stats()
