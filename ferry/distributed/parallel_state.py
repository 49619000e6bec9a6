"""The tensor-parallel group: its rank and size, and the collectives the model and runner use.

Rank 0 is the engine process: it schedules, builds each step's inputs, broadcasts them
(a pickled `StepPlan`, over a gloo group on the CPU so no device sync is needed), runs its
shard of the model and samples. Ranks 1..N-1 run the same forward on their shards
(ferry/worker/tp_worker.py). NCCL carries the activations on GPU, gloo on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    cpu_group: object | None = None  # gloo: step plans and control messages

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """In place, the elementwise maximum over ranks (e.g. a sharded weight's column maxima)."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank-major."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj=None):
        """Rank 0 sends `obj`; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_across_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV-cache budget each GPU can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
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


SINGLE = TensorParallel()


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return TensorParallel(rank, size, cpu_group)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
