"""A CPU model's GGUF blocks moved into one arena of transparent huge pages, in the order a decode step
reads them.

Each weight comes off the loader as its own allocation, and torch's allocator asks for no huge pages
below 2 MiB (THP_MEM_ALLOC_ENABLE), so SmolLM2's projections (0.2-1.1 MB each) sat on 4 KiB pages:
a batch-1 step streamed its 97 MB through ~24,000 pages, each a TLB miss and, on a VM, a
two-dimensional page walk, with the hardware prefetchers stopping at every page's end. A plain sum
over a 256 MB buffer read 26-27 GB/s on such pages and 31-32 GB/s on huge ones (the 2-vCPU KVM guest,
2026-11-27). Moved into one `lazy_zeros` mapping (MADV_HUGEPAGE) in the step's order (each layer's
qkv, o, gate_up, down, a mixture's experts; then the head), the same step's layers took 3.25 ms
against 3.54 and its head 0.76 against 0.88 (medians of ~1,400 steps each, the two layouts alternated
in one process; BENCHMARKS.md, session 26). The bytes and the kernels are the same: only where the
bytes live changes, and each weight is still one copy (the old allocation is freed as its blocks move).
"""

from __future__ import annotations

import logging

import torch

from ferry.layers.gguf_linear import GGUFWeight
from ferry.models.llama import SparseMoeBlock
from ferry.utils import lazy_zeros

logger = logging.getLogger(__name__)

ALIGN = 64  # a cache line: the kernels' vector loads; the weights otherwise follow one another


def step_order(model) -> list[GGUFWeight]:
    """The model's CPU GGUF weights in the order a decode step reads them, each once (a tied head is
    the embedding's blocks)."""
    order: list[GGUFWeight] = []
    seen: set[int] = set()

    def add(*weights) -> None:
        for w in weights:
            if isinstance(w, (list, tuple)):
                add(*w)
            elif isinstance(w, GGUFWeight) and id(w) not in seen and w.data.device.type == "cpu":
                seen.add(id(w))
                order.append(w)

    def add_modules(root) -> None:  # in registration order: q/k/v, o; gate/up, down
        for module in root.modules():
            add(getattr(module, "gguf", None))

    for layer in model.layers:
        add_modules(layer.self_attn)
        if isinstance(layer.mlp, SparseMoeBlock):  # the routed experts one by one, then a shared expert
            experts = layer.mlp.experts
            for e in range(len(experts.gguf13 or [])):
                add(experts.gguf13[e], experts.gguf2[e])
        add_modules(layer)  # a dense MLP, a shared expert, anything else the layer holds as blocks
    add(getattr(model, "_gguf_lm_head", None))
    embed = getattr(model, "embed_tokens", None)
    add(getattr(embed, "gguf", None))
    return order


def gather_gguf_weights(model) -> int:
    """Move the model's CPU GGUF weights into one huge-page arena in step order (see the module's
    docstring); returns the arena's size in bytes (0: nothing to move). Call once the weights are
    final (interleaved) and before anything holds their tensors (the C++ decode step is built after)."""
    weights = step_order(model)
    sizes = [w.data.numel() * w.data.element_size() for w in weights]
    total = sum(-(-n // ALIGN) * ALIGN for n in sizes)
    if total < lazy_zeros.LAZY_MIN_BYTES:  # a tiny model: its own pages are as good
        return 0
    arena = lazy_zeros.zeros((total,), torch.uint8, "cpu")
    offset = 0
    for w, n in zip(weights, sizes):
        blocks = arena[offset : offset + n].view(w.data.dtype).view(w.data.shape)
        blocks.copy_(w.data)
        w.data = blocks  # the old allocation goes when its last reference does
        offset += -(-n // ALIGN) * ALIGN
    logger.info("GGUF weights in one huge-page arena: %.1f MB in %d tensors, in decode-step order", total / 1e6,
                len(weights))  # fmt: skip
    return total
