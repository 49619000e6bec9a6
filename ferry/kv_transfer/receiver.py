"""The decode side's socket (a ZMQ ROUTER on its own thread): answers offers with how many leading
blocks this cache holds, turns pushes (frames or a shared-memory segment) into ImportJobs for the
core thread, and sends the core's `Done` back.

A peer that announces or sends more than this whole cache could hold is refused before anything
is assembled; a shared-memory segment is read only up to its announced size, and only a segment
this receiver named for that transfer (in its `Have`). With a deployment secret (utils/deployment_secret.py) every
message must carry a valid MAC, and replays are dropped, before anything is decoded.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory

import msgspec
import zmq

from ferry.kv_transfer.blocks import KVBlocks
from ferry.kv_transfer.core_channel import CoreChannel
from ferry.kv_transfer.protocol import Done, Have, Offer, Push, WireMessage
from ferry.utils.deployment_secret import AuthError, MessageAuth

logger = logging.getLogger("ferry.kv_transfer")


@dataclass
class ImportJob:
    """Blocks a sender pushed: the core imports them and the receiver answers `Done`."""

    transfer_id: str
    payload: KVBlocks | None
    identity: bytes
    error: str | None = None
    received_at: float = field(default_factory=time.monotonic)


class Receiver:
    """The decode side's socket: answers offers, turns pushes into ImportJobs, sends Done."""

    def __init__(
        self,
        channel: CoreChannel,
        host: str,
        port: int,
        max_payload_bytes: int,
        has_block: Callable[[bytes], bool],
        secret: bytes | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.channel = channel
        self.has_block = has_block
        self.auth = MessageAuth(secret)
        self.timeout = timeout
        self._shm_names: dict[str, tuple[str, float]] = {}  # transfer id -> (the segment we named, when)
        self.replies: queue.Queue = queue.Queue()
        ctx = channel.ctx
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A peer that sends more than the whole cache could hold is cut off, not buffered.
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_payload_bytes + (1 << 20))  # per frame; the total: _assemble
        self.max_payload_bytes = max_payload_bytes
        bind_host = f"[{host}]" if ":" in host else host
        if port:
            self.sock.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        self.addr = f"tcp://{bind_host}:{port}"
        self._wake_addr = f"inproc://ferry-kv-replies-{uuid.uuid4().hex}"
        self.wake = ctx.socket(zmq.PULL)
        self.wake.bind(self._wake_addr)
        self._core_waker: zmq.Socket | None = None  # the core thread's end of `wake`
        self._stopped = threading.Event()

    def reply(self, identity: bytes, done: Done) -> None:
        """From the core thread, after an import."""
        self.replies.put((identity, done))
        if self._core_waker is None:
            self._core_waker = self.channel.ctx.socket(zmq.PUSH)
            self._core_waker.setsockopt(zmq.LINGER, 0)
            self._core_waker.connect(self._wake_addr)
        try:
            self._core_waker.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def stop(self) -> None:
        """From the core thread."""
        self._stopped.set()
        if self._core_waker is not None:
            self._core_waker.close(linger=0)

    def run(self) -> None:
        decoder = msgspec.msgpack.Decoder(WireMessage)
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wake, zmq.POLLIN)
        waker = self.channel.waker()
        try:
            while not self._stopped.is_set():
                ready = dict(poller.poll(200))
                if self.wake in ready:
                    while True:
                        try:
                            self.wake.recv(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                while True:
                    try:
                        identity, done = self.replies.get_nowait()
                    except queue.Empty:
                        break
                    self.sock.send_multipart([identity, *self.auth.seal([encoder.encode(done)])])
                if self.sock not in ready:
                    continue
                frames = self.sock.recv_multipart(copy=False)
                identity = frames[0].bytes
                try:
                    body = self.auth.open(frames[1:])
                    msg = decoder.decode(body[0].buffer)
                except (AuthError, msgspec.DecodeError, IndexError) as e:
                    logger.warning("KV transfer message refused: %s", e)
                    continue
                if isinstance(msg, Offer):
                    held = 0
                    while held < len(msg.block_hashes) and self.has_block(msg.block_hashes[held]):
                        held += 1
                    have = Have(msg.transfer_id, held, self._name_segment(msg.transfer_id))
                    self.sock.send_multipart([identity, *self.auth.seal([encoder.encode(have)])])
                elif isinstance(msg, Push):
                    self.channel.post(self._assemble(msg, body[1:], identity), waker)
        finally:
            self.sock.close(linger=0)
            self.wake.close(linger=0)
            waker.close(linger=0)

    def _name_segment(self, transfer_id: str) -> str:
        """The shared-memory name the sender of this transfer must use (forgotten after 2 timeouts)."""
        now = time.monotonic()
        if len(self._shm_names) > 256:
            self._shm_names = {t: v for t, v in self._shm_names.items() if now - v[1] < 2 * self.timeout}
        name = f"ferry-kv-{uuid.uuid4().hex}"
        self._shm_names[transfer_id] = (name, now)
        return name

    def _assemble(self, msg: Push, frames: list, identity: bytes) -> ImportJob:
        meta = msg.meta
        try:
            if msg.shm_name is not None:
                issued = self._shm_names.pop(msg.transfer_id, (None, 0.0))[0]
                if msg.shm_name != issued:
                    raise ValueError(f"shared-memory segment {msg.shm_name!r} was not named by this receiver")
                shm = shared_memory.SharedMemory(name=msg.shm_name)
                try:
                    # The sender owns (and unlinks) the segment; without this, this process's
                    # resource tracker would unlink it too, or warn, at exit.
                    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
                    scales = meta.num_blocks * meta.num_layers * 2 * meta.block_size * meta.num_kv_heads * 4
                    total = msg.data_bytes + (scales if meta.encoding == "int8" else 0)
                    if total > shm.size:
                        raise ValueError(f"shared-memory segment of {shm.size} bytes, {total} announced")
                    blob = bytes(shm.buf[:total])
                finally:
                    shm.close()
            else:
                if sum(len(f.buffer) for f in frames) > self.max_payload_bytes:
                    raise ValueError("more KV bytes than this whole cache holds")
                blob = b"".join(f.buffer for f in frames)
            meta.data = blob[: msg.data_bytes]
            meta.scales = blob[msg.data_bytes : len(blob)] if meta.encoding == "int8" else b""
            return ImportJob(msg.transfer_id, meta, identity)
        except Exception as e:  # e.g. the segment is gone (sender timed out), or another host's
            return ImportJob(msg.transfer_id, None, identity, error=f"{type(e).__name__}: {e}")
