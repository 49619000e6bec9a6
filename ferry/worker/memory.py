"""How many KV-cache blocks one rank can hold.

The bytes of a block follow from the model's geometry; the budget is `--kv-cache-memory-bytes`,
or 2 GiB on the CPU, or on CUDA: gpu_memory_utilization x the GPU's memory, minus what other
processes hold, minus the engine's own peak without a KV cache (measured by a profiling forward
of the largest step it can schedule), minus room for the CUDA graphs' memory pool.
"""

from __future__ import annotations

import logging

import torch

from ferry.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs
from ferry.kv_quant import kv_cache_bytes_per_token, row_bytes
from ferry.models.config import ModelConfig
from ferry.worker.model_runner import ModelRunner
from ferry.worker.step_plan import profiling_blocks, profiling_plan

logger = logging.getLogger(__name__)

# Kept free for the CUDA graphs' memory pool (decode activations of the largest batch).
CUDA_GRAPH_RESERVE_BYTES = 1 << 30


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1,
                       num_layers: int | None = None) -> int:  # fmt: skip
    """Bytes of one block on one rank (its share of the KV heads), the scales of a quantized cache included."""
    return block_size * kv_bytes_per_token(cfg, dtype, tp_size, num_layers)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tp_size: int = 1, num_layers: int | None = None) -> int:
    """One token's cache over the rank's layers (`num_layers`, default all: a pipeline stage holds its
    own) on one rank: its share of the K and V heads, or MLA's one latent row (latent and rotary
    key), which every rank holds whole."""
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    if cfg.is_mla:
        return layers * row_bytes(cfg.kv_cache_width, dtype)
    return kv_cache_bytes_per_token(layers, max(1, cfg.num_key_value_heads // tp_size), cfg.head_dim, dtype)


@torch.inference_mode()
def profile_peak_memory(runner: ModelRunner, num_tokens: int, chunk: int, num_seqs: int) -> int:
    """Peak CUDA bytes of a forward over `num_tokens` prompt tokens (in chunks of at most `chunk`)
    plus the logits and sampling of `num_seqs` rows, with a KV cache just big enough (freed
    after): what the KV cache must leave free. Every rank runs it together (the forward has
    collectives)."""
    device = runner.device
    blocks = profiling_blocks(num_tokens, chunk, runner.block_size)
    runner.allocate_kv_cache(blocks)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    plan = profiling_plan(num_tokens, chunk, num_seqs, runner.block_size, runner.model.config.vocab_size)
    logits = runner.profile_forward(plan)
    if logits is not None:
        # The sampler's temporaries at their largest: penalties, top-k/p (sorted values, their
        # int64 indices, mask, probabilities, cumulative sum), noise, logprobs: ~8 fp32 copies.
        scratch = [logits.float() for _ in range(8)]
        del scratch
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    runner.free_kv_cache()
    torch.cuda.empty_cache()
    return peak - runner_block_bytes(runner) * blocks


def runner_block_bytes(runner: ModelRunner) -> int:
    """Bytes of one KV block in this runner's cache: its TP share of its stage's layers."""
    cfg = runner.model.config
    return kv_bytes_per_block(cfg, runner.block_size, runner.cache_dtype, runner.tp.size, len(runner.model.layers))


def gpu_kv_blocks(runner: ModelRunner, args: EngineArgs) -> int:
    """The KV blocks this rank's GPU can hold (gpu_kv_budget over its own block size: pipeline
    stages hold different layer counts)."""
    return blocks_in_budget(gpu_kv_budget(runner, args), runner_block_bytes(runner))


def gpu_kv_budget(runner: ModelRunner, args: EngineArgs) -> int:
    """This rank's KV-cache bytes: gpu_memory_utilization x total, minus what others hold on the
    GPU, minus the engine's peak without a KV cache (weights + activations of a full prefill
    step + sampling, measured by a profiling forward), minus room for the CUDA graphs' pool."""
    device = runner.device
    num_tokens = args.max_num_batched_tokens
    # Positions of the profiled chunks stay inside the model's context (and its rotary tables).
    chunk = min(num_tokens, args.max_model_len or runner.model.config.context_length)
    peak = profile_peak_memory(runner, num_tokens, chunk, args.max_num_seqs)
    # After the profile: NCCL, cuBLAS and Triton set up their (non-torch) memory during it.
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    others = (total - free) - torch.cuda.memory_reserved(device)
    graphs = 0 if args.enforce_eager or runner.attn_backend.name != "triton" else CUDA_GRAPH_RESERVE_BYTES
    budget = int(total * args.gpu_memory_utilization) - others - peak - graphs
    logger.info("GPU %s: %.1f GiB total, %.2f GiB others, %.2f GiB peak without KV cache -> %.2f GiB KV", device,
                total / 2**30, others / 2**30, peak / 2**30, budget / 2**30)  # fmt: skip
    return budget


def host_kv_budget(args: EngineArgs) -> int:
    """The budget when no GPU is profiled: the user's bytes, else the CPU default."""
    return args.kv_cache_memory_bytes if args.kv_cache_memory_bytes is not None else DEFAULT_CPU_KV_CACHE_BYTES


def blocks_in_budget(budget: int, block_bytes: int) -> int:
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(f"KV-cache budget {budget} bytes is smaller than one block ({block_bytes} bytes)")
    return int(blocks)
