"""Which decoder layers each pipeline stage holds: contiguous runs balanced by measured cost.

Layers of one model need not cost the same: a mixture-of-experts layer is not a dense one (DeepSeek's
first layers are dense, Qwen's `mlp_only_layers` too), and stage 0 also runs the embedding and the
output head (rank 0 samples), which for a small model with a large vocabulary is worth several
layers (SmolLM2's head has as many parameters as eight of its layers). So the partition is not by
count: one layer of each kind and the head are built with random weights on the device, timed on a
step of `PROBE_TOKENS` tokens (the head over as many rows, as in a decode step), and the layers split
into contiguous runs that minimise the slowest stage (stage 0 charged the head).
`FERRY_PP_LAYER_PARTITION="10,14"` (layers per stage, as vLLM's VLLM_PP_LAYER_PARTITION) overrides it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from ferry.distributed.parallel_state import SINGLE
from ferry.kernels.cpu import cpu_kernels_enabled
from ferry.kv_quant import row_width
from ferry.layers.attention import one_prompt_metadata
from ferry.layers.linear import pack_weight, packed_linear, should_pack
from ferry.layers.rotary import RotaryEmbedding
from ferry.models.config import ModelConfig
from ferry.models.llama import DecoderLayer

logger = logging.getLogger(__name__)

PARTITION_ENV = "FERRY_PP_LAYER_PARTITION"
PROBE_TOKENS = 64
# A probe layer's routed experts are capped to about this many bytes (DeepSeek-V3's 256 experts are
# 22 GB a layer in bf16): what a step of PROBE_TOKENS reads is what matters, not the ones it leaves.
_PROBE_EXPERT_BYTES = 1 << 30


def layer_partition(cfg: ModelConfig, stages: int, device: torch.device, dtype: torch.dtype) -> list[tuple[int, int]]:
    """[first, end) of the layers of each of `stages` stages."""
    n = cfg.num_hidden_layers
    if stages > n:
        raise ValueError(f"pipeline_parallel_size ({stages}) exceeds the model's {n} layers")
    if stages == 1:
        return [(0, n)]
    given = os.environ.get(PARTITION_ENV)
    if given:
        return partition_from_counts(given, n, stages)
    costs, head = measure_layer_costs(cfg, device, dtype)
    ranges = balanced_partition(costs, stages, head)
    loads = [sum(costs[a:b]) + (head if i == 0 else 0.0) for i, (a, b) in enumerate(ranges)]
    logger.info("pipeline stages (layers %s) from measured costs: layer %s ms, head %.3f ms; stage loads %s ms",
                ranges, sorted({round(c * 1e3, 3) for c in costs}), head * 1e3,
                [round(x * 1e3, 2) for x in loads])  # fmt: skip
    return ranges


def partition_from_counts(text: str, num_layers: int, stages: int) -> list[tuple[int, int]]:
    """FERRY_PP_LAYER_PARTITION's layers per stage ("10,14") as ranges."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise ValueError(f"{PARTITION_ENV} must be comma-separated layer counts, got {text!r}") from None
    if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"{PARTITION_ENV}={text!r}: need {stages} positive counts summing to {num_layers} layers")
    bounds = np.cumsum([0] + counts)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def balanced_partition(costs: list[float], stages: int, first_extra: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous runs of layers, at least one each, minimising the largest stage cost, stage 0
    charged `first_extra` besides its layers (dynamic programming over split points)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} stages")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    inf = float("inf")
    # best[s][i]: the smallest possible slowest stage when the first s + 1 stages hold layers [0, i).
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = prefix[i] + first_extra
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    ends = [n]
    for s in range(stages - 1, 0, -1):
        ends.append(cut[s][ends[-1]])
    bounds = [0] + ends[::-1]
    return list(zip(bounds[:-1], bounds[1:]))


def _layer_kind(cfg: ModelConfig, i: int) -> tuple:
    return (i in cfg.moe_layers,)


def _probe_config(cfg: ModelConfig, dtype: torch.dtype) -> ModelConfig:
    """`cfg` with its routed experts capped to _PROBE_EXPERT_BYTES a layer (grouped routing off
    when capped: the groups no longer divide the experts)."""
    if not cfg.moe_layers:
        return cfg
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * torch.finfo(dtype).bits // 8
    cap = max(cfg.num_experts_per_tok, _PROBE_EXPERT_BYTES // per_expert)
    if cfg.num_experts <= cap:
        return cfg
    return dataclasses.replace(cfg, num_experts=cap, moe_n_group=1, moe_topk_group=1)


@torch.inference_mode()
def measure_layer_costs(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[list[float], float]:
    """Seconds of each layer, and of the output head, on a step of PROBE_TOKENS prompt tokens (the
    best of three after a warm-up), one layer of each kind built with random weights."""
    probe = _probe_config(cfg, dtype)
    T = PROBE_TOKENS
    with torch.device(device):
        rotary = RotaryEmbedding(cfg.head_dim, max(T, 16), cfg.rope_theta, cfg.rope_scaling)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, cfg.hidden_size, generator=gen, device=device).to(dtype)
    meta, positions = one_prompt_metadata(T, device)
    by_kind: dict[tuple, float] = {}
    for i in range(cfg.num_hidden_layers):
        kind = _layer_kind(cfg, i)
        if kind in by_kind:
            continue
        layer = DecoderLayer(probe, rotary, SINGLE, i).to(device=device, dtype=dtype)
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() > 1:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.zero_()
        if should_pack(device, dtype) and cpu_kernels_enabled():  # as the loader packs them
            for m in layer.modules():
                if hasattr(m, "pack") and callable(m.pack):
                    m.pack()
        shape = (T, 1, layer.self_attn.num_kv_heads, row_width(cfg.kv_cache_width, dtype))
        cache = torch.zeros(shape, dtype=dtype, device=device)
        kv = (cache, cache if cfg.is_mla else torch.zeros_like(cache))
        by_kind[kind] = _best_time(functools.partial(layer, x, None, positions, kv, meta), device)
        del layer, kv, cache
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, device=device).to(dtype)
    if should_pack(device, dtype) and cpu_kernels_enabled():  # as LlamaForCausalLM.pack_linear_weights does
        packed = pack_weight(head)
        head_cost = _best_time(lambda: packed_linear(x, packed, None), device)
    else:
        head_cost = _best_time(lambda: F.linear(x, head), device)
    return [by_kind[_layer_kind(cfg, i)] for i in range(cfg.num_hidden_layers)], head_cost


def _best_time(fn, device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up: allocations, kernel selection
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best
