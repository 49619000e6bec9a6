"""Several nodes (`ferry serve --nnodes N --node-rank R --master-addr A --master-port P`): two "nodes" on
loopback, real processes over gloo, give one process's greedy tokens."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from ferry.config import EngineArgs
from ferry.utils.network import free_port
from tests.worker.test_tensor_parallel import checkpoint, generate, generate_with_engine  # noqa: F401 (fixture)


def start_node(rank: int, port: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ferry.cli", "serve", "--nnodes", "2", "--node-rank", str(rank), "--master-addr",
           "127.0.0.1", "--master-port", str(port), *flags]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_tp2_pp2_match_one_process(checkpoint):  # noqa: F811
    """Ranks 0-1 (stage 0, tensor-parallel) on node 0 with the engine, ranks 2-3 (stage 1) on node 1,
    which is given only the layout: it takes the model, shapes and layer partition from node 0."""
    port = free_port()
    node1 = start_node(1, port, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--device", "cpu")
    try:
        tokens, _ = generate_with_engine(checkpoint, 2, pipeline_parallel_size=2, nnodes=2, node_rank=0,
                                              master_addr="127.0.0.1", master_port=port)  # fmt: skip
        out, _ = node1.communicate(timeout=300)  # the engine's shutdown ends node 1's ranks
        assert node1.returncode == 0, out
        assert "node 1 of 2: ranks 2..3" in out
    finally:
        if node1.poll() is None:
            node1.kill()
    assert tokens == generate(checkpoint, 1)


def test_a_node_started_with_another_layout_is_refused():
    """Node 1 reads node 0's arguments from the rendezvous store before starting any rank; a different
    parallel layout is a clear error (exit 2), not a hang."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    node0 = EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, master_port=port)
    store.set("ferry/engine_args", json.dumps(dataclasses.asdict(node0)))
    store.set("ferry/layer_ranges", json.dumps([[0, 1], [1, 2]]))
    node1 = start_node(1, port, "--tensor-parallel-size", "1", "--pipeline-parallel-size", "2")
    out, _ = node1.communicate(timeout=120)
    assert node1.returncode == 2, out
    assert "node 0 runs --tensor-parallel-size 2, this node was started with 1" in out


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(nnodes=2, tensor_parallel_size=3, master_port=1234), "do not split evenly over 2 nodes"),
        (dict(nnodes=2, tensor_parallel_size=2), "need --master-port"),
        (dict(nnodes=2, node_rank=2, tensor_parallel_size=2, master_port=1234), "node_rank must be in"),
    ],
)
def test_multi_node_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)
