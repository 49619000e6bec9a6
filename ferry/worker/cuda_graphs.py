"""CUDA graphs for decode-only steps.

A decode step of a small model on a GPU is dominated by kernel launches (hundreds per
step); replaying a captured graph issues them all at once. One graph per batch size in
1, 2, 4, 8, then steps of 16 up to max_num_seqs, captured largest first in one memory
pool; a batch runs in the smallest graph that holds it. The inputs live in static
buffers: token ids, positions, slots, block tables and context lengths are copied in
before each replay. Padded rows get slot -1 (the store kernel writes nothing) and
context length 0 (the decode kernel reads nothing and returns zeros), so they touch no
request's KV. Steps with prefill chunks run eagerly. Only the Triton backend is captured:
its decode launch's shape depends on the batch size alone.
"""

from __future__ import annotations

import logging
import time

import torch

from ferry.layers.attention import AttentionBackend, AttentionMetadata
from ferry.models.llama import LlamaForCausalLM
from ferry.utils.math import cdiv
from ferry.worker.step_plan import StepPlan

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CUDAGraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attn_backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool = True,
    ) -> None:
        """`kv_caches` must stay the tensors the graphs are captured over. `use_graphs=False` runs
        the same static-buffer path eagerly (how the tests check the padding on the CPU, where
        there are no graphs)."""
        # What a replay needs, held directly (not through the ModelRunner that owns this object,
        # which would be a cycle keeping a dropped engine's KV cache and graph pool alive).
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.use_graphs = use_graphs
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        dev = device
        self.max_blocks = cdiv(max_model_len, block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        # Host staging, pinned on a GPU: one copy per buffer per replay.
        pin = dev.type == "cuda"
        self.host = torch.zeros(4, n, dtype=torch.long, pin_memory=pin)
        self.host_tables = torch.zeros(n, self.max_blocks, dtype=torch.long, pin_memory=pin)
        self.copied = torch.cuda.Event() if pin else None  # the last step's staging copies are done

    def _metadata(self, batch: int) -> AttentionMetadata:
        backend = self.attn_backend
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            block_size=self.block_size,
            num_decodes=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_seq_lens=self.seq_lens[:batch],
            backend=backend,
        )
        backend.prepare(meta)
        return meta

    def _forward(self, batch: int) -> torch.Tensor:
        return self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches, self._metadata(batch))

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        for batch in reversed(self.sizes):
            self._forward(batch)  # warm-up: Triton compiles, allocators settle
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[batch] = self._forward(batch)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (decode batch sizes up to %d) in %.1fs",
                    len(self.graphs), self.sizes[-1], time.perf_counter() - t0)  # fmt: skip

    def fits(self, plan: StepPlan) -> bool:
        return not plan.prefills and plan.decode_tree is None and 0 < plan.num_decodes <= self.sizes[-1]

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Replay the smallest graph holding the batch; returns its hidden states [num_decodes, hidden]."""
        b = plan.num_decodes
        size = next(s for s in self.sizes if s >= b)
        host = self.host
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies read these pinned buffers
        host[0, :b] = torch.from_numpy(plan.input_ids)
        host[1, :b] = torch.from_numpy(plan.positions)
        host[2, :b] = torch.from_numpy(plan.slot_mapping)
        host[3, :b] = torch.from_numpy(plan.decode_seq_lens)
        host[0:2, b:size] = 0
        host[2, b:size] = -1
        host[3, b:size] = 0
        width = max(len(blocks) for blocks in plan.decode_blocks)
        # A contiguous [b, width] view of the pinned buffer, so the copy is one pinned DMA.
        tables = self.host_tables.view(-1)[: b * width].view(b, width)
        rows = tables.numpy()  # filled through NumPy: a torch op per row costs ~2 us of host time
        rows.fill(0)
        for i, blocks in enumerate(plan.decode_blocks):
            rows[i, : len(blocks)] = blocks
        self.input_ids[:size].copy_(host[0, :size], non_blocking=True)
        self.positions[:size].copy_(host[1, :size], non_blocking=True)
        self.slot_mapping[:size].copy_(host[2, :size], non_blocking=True)
        self.seq_lens[:size].copy_(host[3, :size], non_blocking=True)
        self.block_tables[:b, :width].copy_(tables, non_blocking=True)
        if not self.use_graphs:
            return self._forward(size)[:b]
        self.copied.record()
        self.graphs[size].replay()
        return self.outputs[size][:b]
