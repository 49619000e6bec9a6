"""Tensor-parallel worker processes (ranks 1..N-1) and their launch from rank 0.

Rank 0 (the engine) broadcasts one control object per action over the gloo group:
  ("profile",)  run the profiling forward together; every rank sizes its KV budget, all take the MIN
  ("init", num_blocks, max_num_seqs, max_model_len)  allocate the KV cache, capture graphs
  StepPlan                           run this step's forward
  None                               exit
Every rank runs the same forward on its shard; the collectives inside the model keep them in
step. A worker that fails exits non-zero; rank 0 then fails at its next collective.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from datetime import timedelta

import torch

from ferry.config import EngineArgs
from ferry.distributed.parallel_state import TensorParallel, init_tensor_parallel
from ferry.utils.network import free_port

logger = logging.getLogger(__name__)


def _device_for_rank(args: EngineArgs, rank: int) -> torch.device:
    from ferry.engine.llm_engine import resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda":
        return torch.device("cuda", rank)
    return device


def init_rank(args: EngineArgs, rank: int, init_method: str) -> TensorParallel:
    device = _device_for_rank(args, rank)
    if device.type == "cpu":
        # The ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tensor_parallel_size))
    return init_tensor_parallel(rank, args.tensor_parallel_size, init_method, device)


def worker_main(args: EngineArgs, rank: int, init_method: str) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # die with the engine process
    except (OSError, AttributeError):
        pass
    logging.basicConfig(level=logging.WARNING)
    tp = init_rank(args, rank, init_method)
    from ferry.engine.llm_engine import gpu_kv_budget, load_model
    from ferry.engine.model_runner import ModelRunner, StepPlan

    model, _, device, dtype, _ = load_model(args, tp)
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
    runner = ModelRunner(model, None, args.block_size, device, dtype, kv_dtype, args.attention_backend, tp)
    while True:
        msg = tp.broadcast_object()
        if msg is None:
            break
        if isinstance(msg, StepPlan):
            runner.forward(msg)
        elif msg[0] == "profile":  # the profiling forward runs on every rank; rank 0 takes the smallest budget
            tp.min_across_ranks(gpu_kv_budget(runner, args))
        elif msg[0] == "init":
            _, num_blocks, max_num_seqs, max_model_len = msg
            runner.allocate_kv_cache(num_blocks)
            if not args.enforce_eager:
                runner.capture_cuda_graphs(max_num_seqs, max_model_len)
    # Rank 0 joins this before tearing down (bounded: never wait on a stuck peer for long).
    torch.distributed.monitored_barrier(group=tp.cpu_group, timeout=timedelta(seconds=30))
    torch.distributed.destroy_process_group()


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks' processes."""

    def __init__(self, args: EngineArgs) -> None:
        n = args.tensor_parallel_size
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

    def broadcast(self, msg) -> None:
        self.tp.broadcast_object(msg)

    def shutdown(self) -> None:
        if not self.procs:
            return
        try:
            if not all(p.is_alive() for p in self.procs):
                raise RuntimeError("a worker is gone")  # a collective with it would wait for its timeout
            self.tp.broadcast_object(None)
            torch.distributed.monitored_barrier(group=self.tp.cpu_group, timeout=timedelta(seconds=30))
        except Exception:  # a worker already died: the collective fails
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.procs = []
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
