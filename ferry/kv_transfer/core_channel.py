"""How the transfer threads hand work to the EngineCore's thread.

Only the core thread touches the block pool and the cache tensors, so a thread posts an event
(an import to do, a finished send or pull) on a queue and wakes the busy loop through an inproc
ZMQ socket the loop polls with its other sockets. Each thread posts through its own PUSH socket
(`waker()`): ZMQ sockets are not shared between threads.
"""

from __future__ import annotations

import queue
import uuid

import zmq


class CoreChannel:
    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.events: queue.Queue = queue.Queue()
        self._addr = f"inproc://ferry-kv-wake-{uuid.uuid4().hex}"
        self.wake = ctx.socket(zmq.PULL)  # the core loop polls this
        self.wake.bind(self._addr)

    def waker(self) -> zmq.Socket:
        """A thread's own socket for `post`."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._addr)
        return sock

    def post(self, event, waker: zmq.Socket) -> None:
        """From a thread: hand an event to the core thread and wake it."""
        self.events.put(event)
        try:
            waker.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is pending already

    def put(self, event) -> None:
        """From the core thread itself: seen at the next `drain` (no wake-up needed)."""
        self.events.put(event)

    def drain(self) -> list:
        """On the core thread: the events posted since the last call."""
        while True:
            try:
                self.wake.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.wake.close(linger=0)
