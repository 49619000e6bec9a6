"""Build one rank's model from a checkpoint: device, dtype, quantization, weights, tokenizer.

Every tensor-parallel rank calls `load_model` for its own shard; rank 0 also keeps the tokenizer
(int8 calibration needs it here, and the engine reads EOS ids from it).
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import torch

from ferry.config import EngineArgs
from ferry.distributed.parallel_state import SINGLE, TensorParallel
from ferry.kernels.cpu import cpu_kernels_enabled
from ferry.layers.int8_linear import int8_linear_available
from ferry.layers.linear import should_pack
from ferry.layers.smoothquant import calibration_token_ids
from ferry.models.config import ModelConfig
from ferry.models.llama import LlamaForCausalLM
from ferry.models.loader import load_checkpoint
from ferry.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    """A loaded model and what was decided while loading it (a tuple too, so tests can unpack it)."""

    model: LlamaForCausalLM
    tokenizer: Any  # None for a checkpoint without one (e.g. --load-format dummy)
    device: torch.device
    dtype: torch.dtype
    path: str  # the resolved checkpoint path


def resolve_device(device: str, rank: int = 0, world_size: int = 1) -> torch.device:
    """`auto`: CUDA when available; under tensor parallelism on CUDA, rank r uses GPU r."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and world_size > 1:
        return torch.device("cuda", rank)
    return dev


def resolve_dtype(dtype: str, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls are ~2x slower than fp32 on CPUs without AMX
    return torch.bfloat16 if cfg.dtype in ("float32", "bfloat16") else getattr(torch, cfg.dtype)


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """`auto`: the model's dtype."""
    return dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)


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


def load_model(args: EngineArgs, tp: TensorParallel = SINGLE) -> LoadedModel:
    """Build our model (this rank's shard) from the checkpoint and load its tokenizer
    (separate from the engine so tests can share one loaded model)."""
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.model, args.load_format, args.seed)
    device = resolve_device(args.device, tp.rank, tp.size)
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
    return LoadedModel(model, tokenizer, device, dtype, ckpt.path)
