"""What pipeline stages send each other: a pickled message (a step plan or a control message), then,
with a step, its activations.

Sends are asynchronous (`isend`): a stage hands its output on and goes back to receive the next
micro-batch while the next stage computes, which is what lets the stages overlap. A send's buffers
are kept until it completes. Messages between two ranks arrive in the order they were sent (one
gloo pair per direction; NCCL p2p on one stream on GPU). The peers are this engine's own ranks,
spawned by rank 0 on this host, so pickle is acceptable here as it is for the tensor-parallel
broadcast; nothing from a client reaches these sockets.
"""

from __future__ import annotations

import pickle
from collections import deque

import torch
import torch.distributed as dist

from ferry.distributed.parallel_state import PipelineStage

# Sends whose buffers are held at once before the oldest is waited for: enough for every micro-batch in
# flight, bounded so that a stuck peer shows up as a stuck sender rather than as growing memory.
_MAX_PENDING_SENDS = 64


class PipelineChannel:
    def __init__(self, pp: PipelineStage, device: torch.device) -> None:
        self.pp = pp
        self.device = device
        self._pending: deque[tuple[object, tuple]] = deque()

    def send(self, dst: int, message: object | None, tensors: tuple[torch.Tensor, ...] = ()) -> None:
        """Send `message` (None: none, only the tensors) and `tensors` to global rank `dst`."""
        if message is not None:
            data = bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            header = torch.tensor([len(data)], dtype=torch.int64)
            payload = torch.frombuffer(data, dtype=torch.uint8)
            for t in (header, payload):
                self._keep(dist.isend(t, dst, group=self.pp.cpu_group), t)
        for t in tensors:
            t = t.contiguous()
            self._keep(dist.isend(t, dst, group=self.pp.group), t)

    def recv_message(self, src: int) -> object:
        header = torch.empty(1, dtype=torch.int64)
        dist.recv(header, src, group=self.pp.cpu_group)
        payload = torch.empty(int(header.item()), dtype=torch.uint8)
        dist.recv(payload, src, group=self.pp.cpu_group)
        return pickle.loads(payload.numpy().tobytes())

    def recv_tensors(self, src: int, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        out = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src, group=self.pp.group)
            out.append(t)
        return out

    def flush(self) -> None:
        """Wait until every send has completed (before tearing the group down)."""
        while self._pending:
            self._pending.popleft()[0].wait()

    def _keep(self, work, buffer: torch.Tensor) -> None:
        self._pending.append((work, (buffer,)))
        while self._pending and (len(self._pending) > _MAX_PENDING_SENDS or self._pending[0][0].is_completed()):
            self._pending.popleft()[0].wait()
