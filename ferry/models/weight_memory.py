"""What a loaded model holds in memory, by part: a census of its weight tensors in every format.

A projection holds its weight in exactly one form: the float parameter, a oneDNN-packed copy
(fp32 on the CPU), int8 (`--quantization int8`) or GGUF blocks. `held_weight_bytes` counts each
tensor object once (a tied GGUF head is the embedding's own blocks), so its total is the
process's weight memory, and a second copy left behind by packing or quantizing shows up in it.
Opaque oneDNN tensors are counted at their logical size (their blocked layout pads little).
"""

from __future__ import annotations

import torch
from torch import nn

from ferry.layers.gguf_linear import GGUFWeight
from ferry.layers.int8_linear import Int8Rows, Int8Weight
from ferry.layers.linear import Linear
from ferry.layers.moe import FusedMoE


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _Census:
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def bytes_of(self, *held) -> int:
        """Bytes of tensors, Int8Weights and GGUFWeights (lists of them too) not counted before."""
        total = 0
        for h in held:
            if h is None or id(h) in self.seen:
                continue
            self.seen.add(id(h))
            if isinstance(h, (list, tuple)):
                total += self.bytes_of(*h)
            elif isinstance(h, GGUFWeight):
                total += h.nbytes + self.bytes_of(h.input_order)
            elif isinstance(h, Int8Weight):
                total += self.bytes_of(h.packed, h.scale, h.zero_point)
            elif isinstance(h, Int8Rows):
                total += self.bytes_of(h.q, h.scale)
            else:
                total += _tensor_bytes(h)
        return total


def held_weight_bytes(model: nn.Module) -> dict[str, int]:
    """{"projections", "experts", "head", "embedding", "other" (norms, routers), "total"}: bytes of this
    rank's weights."""
    census = _Census()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    projections = sum(census.bytes_of(m.weight, m.bias, m.packed, m.int8, m.gguf) for m in linears)
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    experts = sum(census.bytes_of(m.w13, m.w2, m.packed13, m.packed2, m.gguf13, m.gguf2) for m in moe)
    embed = model.embed_tokens
    embedding = census.bytes_of(embed.weight, embed.gguf) if embed is not None else 0
    lm_head = model.lm_head
    head = census.bytes_of(
        None if lm_head is None else lm_head.weight, model._packed_lm_head, model._int8_lm_head, model._gguf_lm_head
    )
    other = sum(census.bytes_of(p) for p in model.parameters())  # what no part above holds: the norms
    total = projections + experts + head + embedding + other
    return {"projections": projections, "experts": experts, "head": head, "embedding": embedding, "other": other,
            "total": total}  # fmt: skip


def process_rss_bytes() -> int | None:
    """This process's resident set (Linux /proc), None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
