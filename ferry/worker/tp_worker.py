"""Tensor-parallel worker processes (ranks 1..N-1) and rank 0's handle on them.

Rank 0 (the engine) broadcasts one control message per action over the gloo group:
  ProfileMemory  run the profiling forward together; every rank sizes its KV budget, all take the MIN
  InitKVCache    allocate the KV cache, capture CUDA graphs
  StepPlan       run this step's forward
  Shutdown       leave the loop and tear the group down
Every rank runs the same forward on its shard; the collectives inside the model keep them in
step. A worker that fails exits non-zero; rank 0 then fails at its next collective.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from ferry.config import EngineArgs
from ferry.distributed.parallel_state import TensorParallel, init_tensor_parallel
from ferry.utils.network import free_port
from ferry.utils.process import die_with_parent
from ferry.worker.memory import gpu_kv_budget
from ferry.worker.model_loading import load_model, resolve_device
from ferry.worker.model_runner import ModelRunner
from ferry.worker.step_plan import StepPlan

logger = logging.getLogger(__name__)


@dataclass
class ProfileMemory:
    """Run the profiling forward; answer with this rank's KV budget in a MIN all-reduce."""


@dataclass
class InitKVCache:
    num_blocks: int
    max_num_seqs: int
    max_model_len: int


@dataclass
class Shutdown:
    """Leave the loop, meet rank 0 at a barrier, destroy the process group."""


ControlMessage = ProfileMemory | InitKVCache | StepPlan | Shutdown

# A barrier with a peer that is stuck must not hold a shutdown for long.
_TEARDOWN_TIMEOUT = timedelta(seconds=30)


def init_rank(args: EngineArgs, rank: int, init_method: str) -> TensorParallel:
    device = resolve_device(args.device, rank, args.tensor_parallel_size)
    if device.type == "cpu":
        # The ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tensor_parallel_size))
    return init_tensor_parallel(rank, args.tensor_parallel_size, init_method, device)


def worker_main(args: EngineArgs, rank: int, init_method: str) -> None:
    die_with_parent()  # with the engine process
    logging.basicConfig(level=logging.WARNING)
    tp = init_rank(args, rank, init_method)
    runner = ModelRunner.create(args, load_model(args, tp), tp)
    while True:
        msg: ControlMessage = tp.broadcast_object()
        if isinstance(msg, StepPlan):
            runner.forward(msg)
        elif isinstance(msg, ProfileMemory):
            tp.min_across_ranks(gpu_kv_budget(runner, args))
        elif isinstance(msg, InitKVCache):
            runner.initialize_kv_cache(msg.num_blocks, msg.max_num_seqs, msg.max_model_len, args.enforce_eager)
        elif isinstance(msg, Shutdown):
            break
        else:
            raise TypeError(f"unexpected tensor-parallel control message {msg!r}")
    # Rank 0 joins this before tearing down (bounded: never wait on a stuck peer for long).
    torch.distributed.monitored_barrier(group=tp.cpu_group, timeout=_TEARDOWN_TIMEOUT)
    torch.distributed.destroy_process_group()


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks' processes."""

    def __init__(self, args: EngineArgs) -> None:
        n = args.tensor_parallel_size
        self.args = args
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or OpenMP state
        self.procs = [
            ctx.Process(target=worker_main, args=(args, rank, init_method), daemon=True, name=f"ferry-tp{rank}")
            for rank in range(1, n)
        ]
        for p in self.procs:
            p.start()
        self.tp = init_rank(args, 0, init_method)

    def check_alive(self) -> None:
        """Raise if a worker has exited: a collective with it would block (inside a CUDA graph,
        with no watchdog, for ever)."""
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) {', '.join(dead)} exited")

    def broadcast(self, msg: ControlMessage) -> None:
        self.tp.broadcast_object(msg)

    def gpu_kv_budget(self, runner: ModelRunner) -> int:
        """Every rank measures its own GPU (memory.gpu_kv_budget); all use the smallest budget,
        since the block tables are shared."""
        self.broadcast(ProfileMemory())
        return self.tp.min_across_ranks(gpu_kv_budget(runner, self.args))

    def initialize_kv_cache(self, runner: ModelRunner, num_blocks: int, max_num_seqs: int, max_model_len: int) -> None:
        """Every rank allocates the same number of blocks and captures its graphs."""
        self.broadcast(InitKVCache(num_blocks, max_num_seqs, max_model_len))
        runner.initialize_kv_cache(num_blocks, max_num_seqs, max_model_len, self.args.enforce_eager)

    def shutdown(self) -> None:
        if not self.procs:
            return
        try:
            if not all(p.is_alive() for p in self.procs):
                raise RuntimeError("a worker is gone")  # a collective with it would wait for its timeout
            self.broadcast(Shutdown())
            torch.distributed.monitored_barrier(group=self.tp.cpu_group, timeout=_TEARDOWN_TIMEOUT)
        except Exception:  # a worker already died: the collective fails
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.procs = []
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
