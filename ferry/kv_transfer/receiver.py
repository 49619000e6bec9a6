"""The decode side's socket (a ZMQ ROUTER on its own thread): answers offers with how many leading
blocks this cache holds, turns pushes (chunk messages or a shared-memory segment) into ImportJobs for the
core thread, and sends the core's `Done` back.

Memory is bounded before anything is buffered: every message is at most a chunk (ZMQ's
MAXMSGSIZE cuts off a peer that sends more in one frame, and a push's bytes come as separate
Chunk messages, protocol.py), a push may announce no more than this whole cache holds, the pushes
being assembled at once no more than that together, and a chunk past its push's announced size
ends the transfer. A shared-memory segment is read only up to its announced size, and only a
segment this receiver named for that transfer (in its `Have`). With a deployment secret
(utils/deployment_secret.py) every message must carry a valid MAC, and replays are dropped,
before anything is decoded.
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
from ferry.kv_transfer.protocol import CHUNK_BYTES, Chunk, Done, Have, Offer, Push, WireMessage
from ferry.utils.deployment_secret import AuthError, MessageAuth, warn_if_unsealed

logger = logging.getLogger("ferry.kv_transfer")


@dataclass
class ImportJob:
    """Blocks a sender pushed: the core imports them and the receiver answers `Done`."""

    transfer_id: str
    payload: KVBlocks | None
    identity: bytes
    error: str | None = None
    received_at: float = field(default_factory=time.monotonic)


@dataclass
class _Assembly:
    """A tcp push whose chunks are arriving."""

    push: Push
    identity: bytes
    parts: list = field(default_factory=list)  # the chunks' buffers (zero-copy views of their frames)
    received: int = 0
    started_at: float = field(default_factory=time.monotonic)


class Receiver:
    """The decode side's socket: answers offers, turns pushes into ImportJobs, sends Done."""

    def __init__(
        self,
        channel: CoreChannel,
        host: str,
        port: int,
        max_payload_bytes: int,
        has_block: Callable[[bytes], bool],
        fingerprint: str,
        secret: bytes | None = None,
        timeout: float = 10.0,
    ) -> None:
        """`fingerprint`: this worker's model and cache (connector.cache_fingerprint); offers of another are refused."""
        self.channel = channel
        self.fingerprint = fingerprint
        self.has_block = has_block
        self.auth = MessageAuth(secret)
        self.timeout = timeout
        self._shm_names: dict[str, tuple[str, float]] = {}  # transfer id -> (the segment we named, when)
        self._assemblies: dict[str, _Assembly] = {}  # tcp pushes whose chunks are arriving
        self._assembling_bytes = 0  # the sizes they announced, together
        self.replies: queue.Queue = queue.Queue()
        ctx = channel.ctx
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Every message is at most one chunk (plus its header): a peer that sends a bigger frame is
        # cut off by ZMQ before it is buffered, and a few such messages are queued per peer at most.
        self.sock.setsockopt(zmq.MAXMSGSIZE, min(CHUNK_BYTES, max_payload_bytes) + (1 << 20))
        self.sock.setsockopt(zmq.RCVHWM, 64)
        self.max_payload_bytes = max_payload_bytes
        bind_host = f"[{host}]" if ":" in host else host
        if port:
            self.sock.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        self.addr = f"tcp://{bind_host}:{port}"
        warn_if_unsealed(f"the KV receiver ({self.addr})", host, secret)
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
                self._expire()
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
                    answer = self._answer(msg)
                    self.sock.send_multipart([identity, *self.auth.seal([encoder.encode(answer)])])
                elif isinstance(msg, (Push, Chunk)):
                    if isinstance(msg, Chunk):
                        job = self._add_chunk(msg, body[1:], identity)
                    elif msg.shm_name is not None:
                        job = self._from_segment(msg, identity)
                    else:
                        job = self._begin(msg, identity)
                    if job is not None:
                        self.channel.post(job, waker)
        finally:
            self.sock.close(linger=0)
            self.wake.close(linger=0)
            waker.close(linger=0)

    def _answer(self, offer: Offer) -> Have | Done:
        """How many leading blocks of the offer this cache holds, or a refusal of another model's blocks."""
        if offer.fingerprint != self.fingerprint:
            error = (
                f"KV blocks of another model or cache layout (fingerprint {offer.fingerprint or 'none'!r}, "
                f"this worker's {self.fingerprint!r}): prefill and decode workers need the same model files, "
                "--block-size and quantized --kv-cache-dtype (int8, fp8), and the same ferry"
            )
            logger.warning("KV offer %s refused: %s", offer.transfer_id, error)
            return Done(offer.transfer_id, False, error=error)
        held = 0
        while held < len(offer.block_hashes) and self.has_block(offer.block_hashes[held]):
            held += 1
        return Have(offer.transfer_id, held, self._name_segment(offer.transfer_id))

    def _name_segment(self, transfer_id: str) -> str:
        """The shared-memory name the sender of this transfer must use (forgotten after 2 timeouts)."""
        now = time.monotonic()
        if len(self._shm_names) > 256:
            self._shm_names = {t: v for t, v in self._shm_names.items() if now - v[1] < 2 * self.timeout}
        name = f"ferry-kv-{uuid.uuid4().hex}"
        self._shm_names[transfer_id] = (name, now)
        return name

    def _begin(self, msg: Push, identity: bytes) -> ImportJob | None:
        """A tcp push: its chunks follow. An ImportJob with an error if it cannot be taken."""
        total = msg.total_bytes
        error = None
        if msg.transfer_id in self._assemblies:
            error = "a second push for one transfer"
        elif not 0 <= msg.data_bytes <= total:
            error = f"a push of {total} bytes announcing {msg.data_bytes} bytes of data"
        elif total > self.max_payload_bytes:
            error = f"more KV bytes ({total}) than this whole cache holds ({self.max_payload_bytes})"
        elif self._assembling_bytes + total > self.max_payload_bytes:
            error = f"{self._assembling_bytes} KV bytes being received already; {total} more would exceed the cache"
        if error is not None:
            return ImportJob(msg.transfer_id, None, identity, error=f"ValueError: {error}")
        if total == 0:
            return self._finish(msg, b"", identity)
        self._assemblies[msg.transfer_id] = _Assembly(msg, identity)
        self._assembling_bytes += total
        return None

    def _add_chunk(self, msg: Chunk, frames: list, identity: bytes) -> ImportJob | None:
        """The next bytes of a push: the ImportJob once complete, an error one if the chunk is wrong."""
        a = self._assemblies.get(msg.transfer_id)
        if a is None or a.identity != identity:
            logger.debug("a KV chunk of no push in progress dropped (%s)", msg.transfer_id)
            return None  # e.g. the rest of a transfer refused or expired already
        buf = frames[0].buffer if len(frames) == 1 else None
        if buf is None or msg.offset != a.received or a.received + len(buf) > a.push.total_bytes:
            self._drop(msg.transfer_id)
            error = "a KV chunk out of order or past the size its push announced"
            return ImportJob(msg.transfer_id, None, identity, error=f"ValueError: {error}")
        a.parts.append(buf)
        a.received += len(buf)
        if a.received < a.push.total_bytes:
            return None
        self._drop(msg.transfer_id)
        return self._finish(a.push, b"".join(a.parts), identity)

    def _drop(self, transfer_id: str) -> None:
        a = self._assemblies.pop(transfer_id, None)
        if a is not None:
            self._assembling_bytes -= a.push.total_bytes

    def _expire(self) -> None:
        """Forget pushes whose chunks stopped coming (their sender has given up by now)."""
        now = time.monotonic()
        for tid in [t for t, a in self._assemblies.items() if now - a.started_at > 2 * self.timeout]:
            a = self._assemblies[tid]
            logger.warning("KV push %s dropped: %d of %d bytes after %.0fs", tid, a.received, a.push.total_bytes,
                           now - a.started_at)  # fmt: skip
            self._drop(tid)

    def _finish(self, msg: Push, blob: bytes, identity: bytes) -> ImportJob:
        meta = msg.meta
        meta.data = blob[: msg.data_bytes]
        meta.scales = blob[msg.data_bytes :] if meta.encoding == "int8" else b""
        return ImportJob(msg.transfer_id, meta, identity)

    def _from_segment(self, msg: Push, identity: bytes) -> ImportJob:
        """An shm push: the bytes are in the segment this receiver named for the transfer."""
        meta = msg.meta
        try:
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
                if total > self.max_payload_bytes:
                    raise ValueError(f"more KV bytes ({total}) than this whole cache holds")
                blob = bytes(shm.buf[:total])
            finally:
                shm.close()
            return self._finish(msg, blob, identity)
        except Exception as e:  # e.g. the segment is gone (sender timed out), or another host's
            return ImportJob(msg.transfer_id, None, identity, error=f"{type(e).__name__}: {e}")
