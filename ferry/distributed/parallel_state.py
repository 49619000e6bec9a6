"""The parallel groups of one engine: tensor parallelism inside each pipeline stage, pipeline stages
one after another. Global rank g is TP rank g % tp of stage g // tp.

Rank 0 is the engine process: it schedules, builds each step's inputs, hands them to the other ranks
(a pickled `StepPlan`: broadcast over a gloo group to its own stage, sent stage to stage with the
activations), runs its shard of stage 0, and samples. The other ranks run the same forward on their
shards (ferry/worker/tp_worker.py). NCCL carries the activations on GPU, gloo on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    """This rank's place in its stage's tensor-parallel group."""

    rank: int = 0
    size: int = 1
    cpu_group: object | None = None  # gloo over this stage's TP ranks: step plans, control messages
    group: object | None = None  # this stage's TP ranks for the activations' collectives (None: the world)
    src: int = 0  # the global rank of this group's TP rank 0 (what broadcasts come from)
    world_cpu_group: object | None = None  # gloo over every rank of every stage (None: cpu_group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """In place, the elementwise maximum over ranks (e.g. a sharded weight's column maxima)."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank-major."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj=None):
        """This group's TP rank 0 sends `obj`; every rank of the group returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.cpu_group)
        return box[0]

    def min_across_ranks(self, value: int) -> int:
        """The smallest of every rank's `value`, over all stages (e.g. the KV blocks each GPU can hold)."""
        group = self.world_cpu_group or self.cpu_group
        if group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())

    def shard(self, n: int, what: str) -> int:
        """This rank's share of n (heads, rows), which must divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) must be divisible by tensor_parallel_size ({self.size})")
        return n // self.size

    def kv_heads(self, n: int) -> int:
        """This rank's KV heads of n: its share, or one replicated head when there are fewer heads
        than ranks (each of the n heads then serves size / n ranks' query heads, as in vLLM)."""
        if n >= self.size:
            return self.shard(n, "num_key_value_heads")
        if self.size % n:
            raise ValueError(f"tensor_parallel_size ({self.size}) must be a multiple of num_key_value_heads ({n}) "
                             "to replicate the KV heads")  # fmt: skip
        return 1

    def kv_head_index(self, n: int) -> int:
        """The first of n KV heads this rank holds."""
        return self.rank * n // self.size if n < self.size else self.rank * (n // self.size)


@dataclass
class PipelineStage:
    """This rank's pipeline stage: which decoder layers it holds and who its neighbours are.

    Stage 0 holds the embedding and the output head besides its layers (rank 0 samples), the last
    stage the final norm; the final hidden states travel from the last stage back to stage 0 (a
    ring), so everything that reads them (sampling, prompt logprobs, pooling, Medusa heads) stays
    on rank 0."""

    stage: int = 0
    size: int = 1
    layers: tuple[int, int] | None = None  # [first, end) of the decoder layers held here; None: all
    prev_rank: int = 0  # global rank of the previous stage's rank with this TP rank (stage 0: the last stage's)
    next_rank: int = 0  # ... of the next stage's (the last stage: stage 0's)
    cpu_group: object | None = None  # gloo over every rank: pickled messages between stages
    group: object | None = None  # the activations between stages (NCCL on GPU; None: the default group)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        return range(num_layers) if self.layers is None else range(*self.layers)


SINGLE = TensorParallel()
SINGLE_STAGE = PipelineStage()


def init_parallel(
    rank: int,
    tp_size: int,
    device: torch.device,
    rendezvous: str | dist.Store,
    layer_ranges: list[tuple[int, int]] | None = None,
) -> tuple[TensorParallel, PipelineStage]:
    """Join the process group of tp_size x len(layer_ranges) ranks (one stage when None) as global
    `rank`, meeting the others at `rendezvous` (an init_method URL, or a store: the engine's
    TCPStore, which also carries what node 0 tells the other nodes), and make the groups: every rank
    creates every group, in the same order."""
    pp_size = len(layer_ranges) if layer_ranges else 1
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = tp_size * pp_size
    if isinstance(rendezvous, str):
        dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, store=rendezvous, rank=rank, world_size=world)
    world_cpu = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    stage, tp_rank = divmod(rank, tp_size)
    group, cpu_group = None, world_cpu
    if pp_size > 1:
        for s in range(pp_size):
            ranks = list(range(s * tp_size, (s + 1) * tp_size))
            g = dist.new_group(ranks)
            c = dist.new_group(ranks, backend="gloo") if backend != "gloo" else g
            if s == stage:
                group, cpu_group = g, c
    tp = TensorParallel(tp_rank, tp_size, cpu_group, group, stage * tp_size, world_cpu)
    pp = PipelineStage(
        stage,
        pp_size,
        layer_ranges[stage] if layer_ranges else None,
        prev_rank=((stage - 1) % pp_size) * tp_size + tp_rank,
        next_rank=((stage + 1) % pp_size) * tp_size + tp_rank,
        cpu_group=world_cpu,
    )
    return tp, pp


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
    """One stage of `size` tensor-parallel ranks."""
    return init_parallel(rank, size, device, init_method)[0]


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
