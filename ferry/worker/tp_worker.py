"""The engine's other ranks (tensor-parallel ranks 1..N-1 of each pipeline stage, and every rank of the
later stages) as worker processes, and rank 0's handle on them.

Rank 0 sends one control message per action; stage 0's ranks get it over their gloo group, and each
stage hands it to the next (the pipeline channel), so every rank sees the same sequence:
  ProfileMemory  run the profiling forward; every rank sizes its KV cache, all take the MIN
  InitKVCache    allocate the KV cache, capture CUDA graphs
  StepPlan       run this step's forward (under pipeline parallelism: this stage's part of it)
  CollectStep    (stage 0, pipeline parallelism) take the oldest step's final hidden states back
  Shutdown       leave the loop and tear the group down
Every rank runs the same forward on its shard; the collectives inside the model keep a stage's ranks
in step, the pipeline channel the stages. A worker that fails exits non-zero; rank 0 then fails at
its next collective.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch

from ferry.config import EngineArgs
from ferry.distributed.parallel_state import PipelineStage, TensorParallel, init_parallel
from ferry.distributed.pipeline_channel import PipelineChannel
from ferry.models.loader import load_checkpoint
from ferry.utils.network import free_port
from ferry.utils.process import die_with_parent
from ferry.worker.memory import gpu_kv_blocks
from ferry.worker.model_loading import load_model, resolve_device, resolve_dtype
from ferry.worker.model_runner import ModelRunner
from ferry.worker.pipeline_partition import layer_partition
from ferry.worker.step_plan import CollectStep, StepPlan

logger = logging.getLogger(__name__)


@dataclass
class ProfileMemory:
    """Run the profiling forward; answer with this rank's KV blocks in a MIN all-reduce."""


@dataclass
class InitKVCache:
    num_blocks: int
    max_num_seqs: int
    max_model_len: int


@dataclass
class Shutdown:
    """Leave the loop, meet rank 0 at a barrier, destroy the process group."""


ControlMessage = ProfileMemory | InitKVCache | Shutdown

# A barrier with a peer that is stuck must not hold a shutdown for long.
_TEARDOWN_TIMEOUT = timedelta(seconds=30)


def init_rank(
    args: EngineArgs, rank: int, init_method: str, layer_ranges: list[tuple[int, int]]
) -> tuple[TensorParallel, PipelineStage, PipelineChannel | None]:
    device = resolve_device(args.device, rank, args.world_size)
    if device.type == "cpu":
        # The ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    tp, pp = init_parallel(rank, args.tensor_parallel_size, device, init_method, layer_ranges)
    channel = PipelineChannel(pp, device) if pp.size > 1 else None
    return tp, pp, channel


def worker_main(args: EngineArgs, rank: int, init_method: str, layer_ranges: list[tuple[int, int]]) -> None:
    die_with_parent()  # with the engine process
    logging.basicConfig(level=logging.WARNING)
    tp, pp, channel = init_rank(args, rank, init_method, layer_ranges)
    runner = ModelRunner.create(args, load_model(args, tp, pp), tp, pp=pp, channel=channel)
    if pp.is_first:
        _first_stage_loop(args, runner, tp, pp, channel)
    else:
        _later_stage_loop(args, runner, pp, channel)
    if channel is not None:
        channel.flush()
    # Rank 0 joins this before tearing down (bounded: never wait on a stuck peer for long).
    torch.distributed.monitored_barrier(group=tp.world_cpu_group, timeout=_TEARDOWN_TIMEOUT)
    torch.distributed.destroy_process_group()


def _first_stage_loop(
    args: EngineArgs, runner: ModelRunner, tp: TensorParallel, pp: PipelineStage, channel: PipelineChannel | None
) -> None:
    """A tensor-parallel rank of stage 0 other than rank 0: follow rank 0's broadcasts."""
    in_flight: deque[StepPlan] = deque()  # steps run here whose hidden states the last stage will send back
    while True:
        msg = tp.broadcast_object()
        if isinstance(msg, StepPlan):
            if pp.size == 1:
                runner.forward(msg)
            else:
                runner.run_first_stage(msg)
                in_flight.append(msg)
        elif isinstance(msg, CollectStep):
            runner.collect(in_flight.popleft())
        else:
            if channel is not None:
                channel.send(pp.next_rank, msg)
            if not _control(msg, runner, args, tp):
                return


def _later_stage_loop(args: EngineArgs, runner: ModelRunner, pp: PipelineStage, channel: PipelineChannel) -> None:
    """A rank of a later pipeline stage: what the previous stage sends, in order."""
    while True:
        msg = channel.recv_message(pp.prev_rank)
        if isinstance(msg, StepPlan):
            runner.run_stage(msg)
            continue
        if not pp.is_last:
            channel.send(pp.next_rank, msg)
        if not _control(msg, runner, args, runner.tp):
            return


def _control(msg: ControlMessage, runner: ModelRunner, args: EngineArgs, tp: TensorParallel) -> bool:
    """Act on a control message; False when it says to stop."""
    if isinstance(msg, ProfileMemory):
        tp.min_across_ranks(gpu_kv_blocks(runner, args))
    elif isinstance(msg, InitKVCache):
        runner.initialize_kv_cache(msg.num_blocks, msg.max_num_seqs, msg.max_model_len, args.enforce_eager)
    elif isinstance(msg, Shutdown):
        return False
    else:
        raise TypeError(f"unexpected control message {msg!r}")
    return True


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks' processes (tensor and pipeline parallel)."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.layer_ranges = self._partition(args)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or OpenMP state
        self.procs = [
            ctx.Process(target=worker_main, args=(args, rank, init_method, self.layer_ranges), daemon=True,
                        name=f"ferry-rank{rank}")  # fmt: skip
            for rank in range(1, args.world_size)
        ]
        for p in self.procs:
            p.start()
        self.tp, self.pp, self.channel = init_rank(args, 0, init_method, self.layer_ranges)

    @staticmethod
    def _partition(args: EngineArgs) -> list[tuple[int, int]]:
        """Each pipeline stage's layers (pipeline_partition.py), decided here before any rank loads."""
        if args.pipeline_parallel_size == 1:
            return []
        cfg = load_checkpoint(args.model, "dummy", args.seed).config  # the config alone
        device = resolve_device(args.device)
        return layer_partition(cfg, args.pipeline_parallel_size, device, resolve_dtype(args.dtype, device, cfg))

    def check_alive(self) -> None:
        """Raise if a worker has exited: a collective with it would block (inside a CUDA graph,
        with no watchdog, for ever)."""
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"worker(s) {', '.join(dead)} exited")

    def broadcast(self, msg: ControlMessage) -> None:
        """A control message to every rank: over stage 0's group, then stage by stage."""
        if self.tp.size > 1:
            self.tp.broadcast_object(msg)
        if self.channel is not None:
            self.channel.send(self.pp.next_rank, msg)

    def gpu_kv_blocks(self, runner: ModelRunner) -> int:
        """Every rank measures its own GPU (memory.gpu_kv_blocks); all use the smallest count,
        since the block tables are shared."""
        self.broadcast(ProfileMemory())
        return self.tp.min_across_ranks(gpu_kv_blocks(runner, self.args))

    def initialize_kv_cache(self, runner: ModelRunner, num_blocks: int, max_num_seqs: int, max_model_len: int) -> None:
        """Every rank allocates the same number of blocks and captures its graphs."""
        self.broadcast(InitKVCache(num_blocks, max_num_seqs, max_model_len))
        runner.initialize_kv_cache(num_blocks, max_num_seqs, max_model_len, self.args.enforce_eager)

    def shutdown(self) -> None:
        """Stop every worker. Steps still in flight must have been collected first (EngineCore.shutdown)."""
        if not self.procs:
            return
        try:
            if not all(p.is_alive() for p in self.procs):
                raise RuntimeError("a worker is gone")  # a collective with it would wait for its timeout
            self.broadcast(Shutdown())
            if self.channel is not None:
                self.channel.flush()
            torch.distributed.monitored_barrier(group=self.tp.world_cpu_group, timeout=_TEARDOWN_TIMEOUT)
        except Exception:  # a worker already died: the collective fails
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.procs = []
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
