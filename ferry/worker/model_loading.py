"""Build one rank's model from a checkpoint: device, dtype, quantization, weights, tokenizer.

Every tensor-parallel rank calls `load_model` for its own shard; rank 0 also keeps the tokenizer
(int8 calibration needs it here, and the engine reads EOS ids from it).
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import torch
from torch import nn

from ferry.config import EngineArgs
from ferry.distributed.parallel_state import SINGLE, SINGLE_STAGE, PipelineStage, TensorParallel
from ferry.kernels.cpu import cpu_kernels_enabled
from ferry.kv_quant import KV_FORMAT_DTYPES
from ferry.layers.gguf_linear import gguf_available, gguf_cuda_available
from ferry.layers.int8_linear import int8_linear_available, int8_triton_available
from ferry.layers.linear import should_pack
from ferry.layers.smoothquant import calibration_token_ids
from ferry.models.config import ModelConfig
from ferry.models.cpu_decode_step import CPUDecodeStep
from ferry.models.llama import LlamaForCausalLM
from ferry.models.loader import Checkpoint, load_checkpoint
from ferry.models.weight_arena import gather_gguf_weights
from ferry.tokenizer import load_tokenizer
from ferry.utils.process import cyclic_gc_paused
from ferry.worker.cpu_allocator import release_free_heap

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
    """`auto`: the model's dtype; `int8` -> torch.int8, `fp8`/`fp8_e4m3` -> torch.float8_e4m3fn (quantized
    rows with their scales, ferry/kv_quant.py)."""
    if kv_cache_dtype == "auto":
        return dtype
    return KV_FORMAT_DTYPES.get(kv_cache_dtype) or getattr(torch, kv_cache_dtype)


def resolve_quantization(
    method: str | None, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, tp: TensorParallel
) -> str | None:
    """What the weights run as: "gguf", "int8" or None (the model dtype). None/"auto" runs a
    quantized GGUF as stored wherever the GGUF kernels run (the CPU in float32, CUDA in
    bf16/fp16/fp32 through Triton; any tensor-parallel size), and says why
    when it cannot; an explicit "gguf" that cannot run is an error. A GPTQ/AWQ/compressed-tensors
    checkpoint (its config.json's quantization_config) runs on the same kernels under None/"auto",
    converted to their blocks at load, else is dequantized to `dtype` with a log line saying why."""
    if method in ("auto", None) and ckpt.hf_quantization is not None:
        cfg = ckpt.config
        in_features = [cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim]
        why = (
            ("the block conversion does not shard over --tensor-parallel-size > 1 yet" if tp.size > 1 else None)
            or _gguf_unavailable(device, dtype)
            or ckpt.hf_quantization.kernel_unsupported(in_features)
        )
        if why:
            logger.info("running the %s checkpoint dequantized to %s: %s", ckpt.hf_quantization.method, dtype, why)
            return None
        logger.info("running the %s checkpoint's quantized weights on the GGUF block kernels",
                    ckpt.hf_quantization.method)  # fmt: skip
        return "gguf"
    if method in ("auto", None):
        if not ckpt.gguf_quantized_tensors():
            return None
        why = _gguf_unavailable(device, dtype)
        if why:
            logger.info("running the GGUF's quantized tensors dequantized to %s: %s", dtype, why)
            return None
        return "gguf"
    if method == "none":
        return None
    if method == "gguf":
        if ckpt.format == "dummy":  # random Q4_0 projections (dummy_weights.py), e.g. to measure the kernels
            why = _gguf_unavailable(device, dtype)
            if why:
                raise ValueError(f"--quantization gguf: {why}")
            return "gguf"
        if ckpt.format != "gguf":
            raise ValueError(f"--quantization gguf needs a GGUF checkpoint, got {ckpt.format}: {ckpt.path}")
        if not ckpt.gguf_quantized_tensors():
            raise ValueError(f"--quantization gguf: {ckpt.path} has no tensor in a type ferry runs quantized")
        why = _gguf_unavailable(device, dtype)
        if why:
            raise ValueError(f"--quantization gguf: {why}")
        return "gguf"
    check_quantization(method, device, dtype)
    return method


def _gguf_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why GGUF blocks cannot run here (None: they can): on the CPU the C++ kernels with float32
    activations; on CUDA the Triton kernels (ferry/kernels/triton_gguf.py) with bf16/fp16/fp32. Under
    tensor parallelism each rank holds its shard's blocks (LlamaForCausalLM._tensor_parallel_slice_gguf)."""
    if device.type == "cuda":
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"the GGUF Triton kernels take bfloat16/float16/float32 activations, not {dtype}"
        if not gguf_cuda_available():
            return "the GGUF Triton kernels need triton (not importable)"
        return None
    if device.type != "cpu":
        return f"the GGUF kernels run on the CPU and CUDA, not {device.type}"
    if dtype != torch.float32:
        return f"the GGUF kernels take float32 activations on the CPU, not {dtype}"
    if not gguf_available():
        return "ferry's CPU kernels could not be built (no C++ compiler?)"
    return None


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Reject a quantization this device/dtype cannot run, before any weight is loaded."""
    if method != "int8":
        return
    if device.type == "cuda":  # the Triton kernels (kernels/triton_int8.py)
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"--quantization int8 on CUDA takes bfloat16/float16/float32 activations, not {dtype}")
        if not int8_triton_available():
            raise ValueError("--quantization int8 on CUDA needs triton (not importable)")
        return
    if device.type != "cpu":
        raise ValueError(f"--quantization int8 runs on the CPU (oneDNN) and CUDA (Triton), not {device.type}")
    if dtype != torch.float32:
        raise ValueError(f"--quantization int8 needs --dtype float32 (activations are fp32), got {dtype}")
    if not int8_linear_available():
        raise ValueError("--quantization int8: this torch build lacks oneDNN's int8 linear ops")


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`model.to(dtype).to_empty(device=device)` for a model built on the meta device, without torch's
    Python meta path: `empty_like` of a meta tensor goes through torch._refs, whose first use imports
    sympy and torch.fx's symbolic shapes (~0.5 s of every server's start). Floating-point tensors take
    `dtype`, as Module.to(dtype) gives them; a tensor two modules share stays shared."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            out = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            made[id(t)] = nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out
        return made[id(t)]

    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is not None:
                    tensors[name] = empty(t)
    return model


def load_model(args: EngineArgs, tp: TensorParallel = SINGLE, pp: PipelineStage = SINGLE_STAGE, *,
               draft: bool = False, tokenizer: bool = True) -> LoadedModel:  # fmt: skip
    """Build our model (this rank's shard of its pipeline stage) from the checkpoint and load its
    tokenizer (separate from the engine so tests can share one loaded model). `draft`: a
    speculative draft, which may draft past its own context (the target checks every token).
    `tokenizer=False`: none is loaded (LoadedModel.tokenizer is None) unless int8 calibration needs
    it: an engine core process's API process tokenizes, and other ranks never do."""
    with cyclic_gc_paused():  # a GGUF's ~100k metadata arrays: ~1.5 s of full collections otherwise
        return _load_model(args, tp, pp, draft, tokenizer)


def _load_model(args: EngineArgs, tp: TensorParallel, pp: PipelineStage, draft: bool,
                with_tokenizer: bool) -> LoadedModel:  # fmt: skip
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.model, args.load_format, args.seed)
    if not draft:
        ckpt.config.check_max_model_len(args.max_model_len)  # before any weight is read
    device = resolve_device(args.device, pp.stage * tp.size + tp.rank, tp.size * pp.size)
    dtype = resolve_dtype(args.dtype, device, ckpt.config)
    quantization = resolve_quantization(args.quantization, ckpt, device, dtype, tp)
    if quantization == "int8" and ckpt.config.moe_layers:
        raise ValueError("--quantization int8 does not cover mixture-of-experts layers yet; run the experts "
                         "in the model dtype (no --quantization) or from a GGUF")  # fmt: skip
    if quantization == "int8" and ckpt.config.is_mla:
        raise ValueError("--quantization int8 does not cover multi-head latent attention yet; "
                         "run the model in its dtype or from a GGUF")  # fmt: skip
    if quantization == "int8" and ckpt.config.sandwich_norms:
        raise ValueError("--quantization int8 does not cover Gemma's sandwich norms yet; run the model in its dtype")
    if quantization == "int8" and pp.size > 1:
        raise ValueError("--quantization int8 calibrates on a forward through every layer, which pipeline "
                         "parallelism splits; run it with --pipeline-parallel-size 1")  # fmt: skip
    model = _build_model(args, ckpt, tp, pp, device, dtype, quantization)
    # After the weights, not in a thread beside them: the tokenizer's load is Python (transformers'
    # import most of its ~1 s) holding the GIL, which the weights' load then waited on; the two took
    # as long side by side as one after the other (BENCHMARKS.md, session 44).
    tokenizer = None
    if with_tokenizer or quantization == "int8":
        tokenizer = load_tokenizer(args.tokenizer or ckpt.path, args.trust_remote_code)
    if quantization == "int8":
        model.quantize_linear_weights_int8(calibration_token_ids(tokenizer, ckpt.config.vocab_size))
    elif should_pack(device, dtype) and cpu_kernels_enabled():
        model.pack_linear_weights()
        if quantization == "gguf":  # (before the C++ step below takes their tensors)
            gather_gguf_weights(model)
    quant = f", {quantization} weights" if quantization else ""
    logger.info("loaded %s (%s%s) in %.1fs", ckpt.path, dtype, quant, time.perf_counter() - t0)
    model.quantization = quantization  # what the weights run as: "gguf", "int8" or None (the dtype)
    # (CUDA: graphs instead; a pipeline stage is not the whole step the C++ call runs)
    if quantization == "gguf" and not args.enforce_eager and device.type == "cpu" and pp.size == 1:
        model.cpu_decode_step = CPUDecodeStep.build(model)
    path = ckpt.path
    del ckpt  # the reader's metadata objects (a GGUF's vocabulary: ~100k small arrays) are garbage now
    if device.type == "cpu":
        release_free_heap()
    elif device.type == "cuda" and quantization == "int8":
        torch.cuda.empty_cache()  # the float originals' blocks, freed as each projection was quantized
    return LoadedModel(model, tokenizer, device, dtype, path)


def _build_model(args: EngineArgs, ckpt, tp: TensorParallel, pp: PipelineStage, device: torch.device,
                 dtype: torch.dtype, quantization: str | None) -> LlamaForCausalLM:  # fmt: skip
    """The model on its device with the checkpoint's weights (not yet packed or quantized to int8)."""
    max_len = args.max_model_len or ckpt.config.context_length
    with torch.device("meta"):
        model = LlamaForCausalLM(ckpt.config, max(max_len, ckpt.config.max_position_embeddings), tp,
                                 expert_parallel=args.enable_expert_parallel, pp=pp)  # fmt: skip
        # GGUF: the quantized blocks are the only copy; those modules never get an fp32 weight.
        # Experts keep their blocks on the CPU (grouped GGUF matmuls); on CUDA they are dequantized for the
        # fused-MoE kernel.
        keep_quantized = (model.plan_gguf(ckpt.quantized_tensors(), experts=device.type == "cpu")
                          if quantization == "gguf" else frozenset())  # fmt: skip
    # Allocated in the target dtype (loaded tensors are cast as they are copied in): no fp32
    # copy of the whole model on the device, which the allocator would keep from the KV cache.
    model = _materialize(model, dtype, device)
    # Dummy weights are generated on the device; another pipeline stage's tensors are not read.
    model.load_weights(ckpt.iter_weights(device, keep_quantized, wanted=model.wants))
    model.init_rotary()  # the empty model's tables are uninitialised; they stay fp32
    model.eval()
    return model
