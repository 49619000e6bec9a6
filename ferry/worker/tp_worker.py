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

The ranks meet at a TCPStore that rank 0 serves (`master_addr:master_port`). Over several nodes
(`--nnodes`), node 0 runs ranks 0..k-1 (rank 0: the engine), and `ferry serve --node-rank r` on node r
runs ranks r*k..(r+1)*k-1 (`run_worker_node`): it reads node 0's engine arguments and the pipeline's
layer partition from the store (JSON, so that a node takes the very model, shapes and flags node 0
runs), starts its ranks and waits for them. The store and torch.distributed's traffic carry no
authentication: master_addr must be on a network only the deployment's nodes reach.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ferry.config import EngineArgs
from ferry.distributed.parallel_state import PipelineStage, TensorParallel, init_parallel
from ferry.distributed.pipeline_channel import PipelineChannel
from ferry.models.loader import load_checkpoint
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
# Nodes may start minutes apart (image pulls, model downloads): how long a rank waits for the others.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
_ENGINE_ARGS_KEY, _LAYERS_KEY = "ferry/engine_args", "ferry/layer_ranges"


def rendezvous_store(args: EngineArgs, rank: int) -> dist.TCPStore:
    """The engine's TCPStore: served by rank 0, joined by every other rank (and worker node)."""
    return dist.TCPStore(args.master_addr, args.master_port, args.world_size, is_master=rank == 0,
                         timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)  # fmt: skip


def init_rank(
    args: EngineArgs, rank: int, store: dist.Store, layer_ranges: list[tuple[int, int]]
) -> tuple[TensorParallel, PipelineStage, PipelineChannel | None]:
    local = rank % args.ranks_per_node  # this node's GPU index
    device = resolve_device(args.device, local, args.world_size)
    if device.type == "cpu":
        # The node's ranks share its cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks_per_node))
    tp, pp = init_parallel(rank, args.tensor_parallel_size, device, store, layer_ranges)
    channel = PipelineChannel(pp, device) if pp.size > 1 else None
    return tp, pp, channel


def worker_main(args: EngineArgs, rank: int, layer_ranges: list[tuple[int, int]]) -> None:
    die_with_parent()  # with the engine process (or the worker node's process)
    logging.basicConfig(level=logging.WARNING)
    tp, pp, channel = init_rank(args, rank, rendezvous_store(args, rank), layer_ranges)
    runner = ModelRunner.create(args, load_model(args, tp, pp, tokenizer=False), tp, pp=pp, channel=channel)
    runner.add_lora_modules(args)  # as rank 0 does: the same adapters in the same slots
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


def _start_ranks(args: EngineArgs, ranks: range, layer_ranges: list[tuple[int, int]]) -> list:
    ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or OpenMP state
    procs = [ctx.Process(target=worker_main, args=(args, rank, layer_ranges), daemon=True, name=f"ferry-rank{rank}")
             for rank in ranks]  # fmt: skip
    for p in procs:
        p.start()
    return procs


def run_worker_node(args: EngineArgs) -> int:
    """Node `args.node_rank` > 0 of a multi-node engine: its ranks, with node 0's engine arguments and
    layer partition (from the rendezvous store), until node 0 shuts them down. 0 when every rank
    exited cleanly."""
    if args.node_rank == 0 or args.nnodes < 2:
        raise ValueError("run_worker_node is for --node-rank 1..nnodes-1 of a multi-node engine")
    store = dist.TCPStore(args.master_addr, args.master_port, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    engine = json.loads(store.get(_ENGINE_ARGS_KEY))
    layer_ranges = [tuple(r) for r in json.loads(store.get(_LAYERS_KEY))]
    # Every node is started with the same parallel layout (as torchrun's nodes are); the rest (model,
    # dtype, shapes, flags) is node 0's.
    for name in ("nnodes", "tensor_parallel_size", "pipeline_parallel_size"):
        if engine[name] != getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"node 0 runs {flag} {engine[name]}, this node was started with {getattr(args, name)}")
    node = EngineArgs(**{**engine, "node_rank": args.node_rank})
    first = node.node_rank * node.ranks_per_node
    logger.info("node %d of %d: ranks %d..%d of %s (%d-way tensor x %d-way pipeline parallel)", node.node_rank,
                node.nnodes, first, first + node.ranks_per_node - 1, node.model or "the bundled model",
                node.tensor_parallel_size, node.pipeline_parallel_size)  # fmt: skip
    procs = _start_ranks(node, range(first, first + node.ranks_per_node), layer_ranges)
    for p in procs:
        p.join()
    failed = [f"{p.name} (exit {p.exitcode})" for p in procs if p.exitcode != 0]
    if failed:
        logger.error("worker node %d: %s", node.node_rank, ", ".join(failed))
    return 1 if failed else 0


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks' processes (tensor and pipeline parallel)."""

    def __init__(self, args: EngineArgs) -> None:
        if args.node_rank != 0:
            raise ValueError("the engine runs on node 0; other nodes run `ferry serve --node-rank R` (workers only)")
        # Rank 0 serves the store; with master_port 0 it binds a port of the kernel's choosing and
        # the other ranks are told that one (a port picked free and bound later could be taken between).
        self.store = rendezvous_store(args, 0)
        if args.master_port == 0:
            args = dataclasses.replace(args, master_port=self.store.port)
        self.args = args
        self.layer_ranges = self._partition(args)
        # What the other nodes run: node 0's arguments, as JSON (no pickles from the network)
        self.store.set(_ENGINE_ARGS_KEY, json.dumps(dataclasses.asdict(args)))
        self.store.set(_LAYERS_KEY, json.dumps(self.layer_ranges))
        self.procs = _start_ranks(args, range(1, args.ranks_per_node), self.layer_ranges)
        self.tp, self.pp, self.channel = init_rank(args, 0, self.store, self.layer_ranges)

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
