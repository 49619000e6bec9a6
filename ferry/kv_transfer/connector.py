"""The KV connector: moves a request's KV blocks between engine cores (prefill/decode disaggregation).

It lives in the EngineCore process, beside the cache it reads and writes, and
never blocks the busy loop: sockets and Redis are served by threads, and
everything that touches the block pool or the cache tensors runs on the core
thread when the loop drains `events` (the threads wake it through the inproc
socket `wake`, which the loop polls with its other sockets).

Roles and transports (`ferry serve --role ... --kv-transfer ...`):
- A prefill worker finishes a request that asked for remote decode
  (`EngineCoreRequest.kv_export`), then exports the prompt's full blocks
  (kv_transfer.py) and a sender thread pushes them:
  - `tcp`: to the decode worker's receiver (ZMQ ROUTER): an offer of the
    hash chain, the receiver answers how many leading blocks it already
    holds, then only the rest go, as raw tensor bytes in 4 MiB frames;
  - `shm`: the same handshake, but the bytes go through a POSIX shared-memory
    segment the receiver maps and the sender unlinks afterwards (same host);
  - `redis`: into a Redis server, one key per block hash (`SET NX EX ttl`,
    skipping keys already there), where any worker can find them.
- Decode workers (and `both`) run the receiver; with a Redis URL, a new
  request whose prompt blocks are not all cached locally first pulls the
  missing ones from Redis (as LMCache does), then is scheduled.
Every wait has a timeout; a transfer that fails allocates nothing on the
receiver (imports are all-or-nothing, kv_transfer.py) and the sender always
releases its buffer or segment. The outcome reaches the API process as a
`KVTransferDone` message.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory

import msgspec
import zmq

from ferry.core.block_hash import BlockHash
from ferry.engine.kv_transfer import KVBlocks

logger = logging.getLogger("ferry.kv_connector")

CHUNK_BYTES = 4 << 20


# -- wire messages (ZMQ, msgspec) --------------------------------------------------


class Offer(msgspec.Struct, tag="offer", array_like=True):
    transfer_id: str
    block_hashes: list[bytes]


class Have(msgspec.Struct, tag="have", array_like=True):
    transfer_id: str
    num_held: int  # leading blocks of the offer the receiver caches already


class Push(msgspec.Struct, tag="push", array_like=True):
    transfer_id: str
    meta: KVBlocks  # data and scales empty: they follow as frames, or in shared memory
    data_bytes: int
    shm_name: str | None = None  # shm: the segment holding data then scales


class Done(msgspec.Struct, tag="done", array_like=True):
    transfer_id: str
    ok: bool
    num_imported: int = 0
    error: str | None = None


WireMessage = Offer | Have | Push | Done


# -- what the threads hand to the core thread -------------------------------------


@dataclass
class ImportJob:
    """Blocks a sender pushed: the core imports them and the receiver answers `Done`."""

    transfer_id: str
    payload: KVBlocks | None
    identity: bytes
    error: str | None = None
    received_at: float = field(default_factory=time.monotonic)


@dataclass
class TransferResult:
    """A finished send (prefill side) or pull (decode side), for the API process's metrics."""

    request_id: str
    direction: str  # "sent" | "received"
    ok: bool
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    payloads: list[KVBlocks] | None = None  # a pull's blocks, imported by the core before the request runs


@dataclass
class _SendJob:
    request_id: str
    payload: KVBlocks
    target: str | None  # tcp://host:port of a receiver (tcp, shm); None for redis
    queued_at: float = field(default_factory=time.monotonic)


class KVConnector:
    def __init__(self, config: KVTransferConfig, ctx: zmq.Context, namespace: str, max_payload_bytes: int) -> None:
        config.validate()
        self.config = config
        self.ctx = ctx
        self.namespace = namespace  # Redis keys: model and cache geometry
        self.events: queue.Queue = queue.Queue()
        self._wake_addr = f"inproc://ferry-kv-wake-{uuid.uuid4().hex}"
        self.wake = ctx.socket(zmq.PULL)
        self.wake.bind(self._wake_addr)
        self.receiver: _Receiver | None = None
        self.receiver_addr: str | None = None
        self.redis = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._has_block = None  # set by the core: hash -> cached here?
        if config.redis_url:
            self.redis = RedisBlockStore(config.redis_url, namespace, config.redis_ttl, config.timeout,
                                         config.redis_max_memory)  # fmt: skip
        self._sends: queue.Queue = queue.Queue()
        self._pulls: queue.Queue = queue.Queue()
        if config.transport is not None:
            self._start(self._send_loop, "ferry-kv-sender")
        if self.redis is not None:
            self._start(self._pull_loop, "ferry-kv-puller")
        if config.receives:
            self.receiver = _Receiver(self, config.host, config.port, max_payload_bytes)
            self.receiver_addr = self.receiver.addr
            self._start(self.receiver.run, "ferry-kv-receiver")

    def _start(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def set_lookup(self, has_block) -> None:
        """`has_block(hash) -> bool`: whether the core's prefix cache holds a block (read from threads:
        a dict lookup, atomic under the GIL; a block evicted right after is merely recomputed)."""
        self._has_block = has_block

    def waker(self) -> zmq.Socket:
        """A thread's own socket for `post` (ZMQ sockets are not shared between threads)."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._wake_addr)
        return sock

    def post(self, event, waker: zmq.Socket) -> None:
        """From a thread: hand an event to the core thread and wake it."""
        self.events.put(event)
        try:
            waker.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is pending already

    def drain(self) -> list:
        """On the core thread: the events the threads posted since the last call."""
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

    # -- prefill side ------------------------------------------------------------------

    def send(self, request_id: str, payload: KVBlocks, target: str | None) -> None:
        """Queue a send; its TransferResult comes back through `drain`."""
        if self.config.transport is None:
            self.events.put(TransferResult(request_id, "sent", False, error="this worker has no --kv-transfer"))
        elif self.config.transport != "redis" and not target:
            self.events.put(TransferResult(request_id, "sent", False, error="no decode worker address to send to"))
        else:
            self._sends.put(_SendJob(request_id, payload, target))

    def _send_loop(self) -> None:
        sockets: dict[str, zmq.Socket] = {}
        waker = self.waker()
        while not self._stop.is_set():
            try:
                job: _SendJob = self._sends.get(timeout=0.5)
            except queue.Empty:
                continue
            t0 = time.monotonic()
            try:
                if t0 - job.queued_at > 2 * self.config.timeout:  # its API request has given up waiting
                    raise TimeoutError(f"waited {t0 - job.queued_at:.1f}s behind other transfers")
                if self.config.transport == "redis":
                    n, nbytes = self.redis.put(job.payload)
                else:
                    n, nbytes = self._push(sockets, job)
                result = TransferResult(job.request_id, "sent", True, n, nbytes, time.monotonic() - t0)
            except Exception as e:  # reported to the API process, which answers without the transfer
                logger.warning("KV transfer of %s failed: %s", job.request_id, e)
                result = TransferResult(job.request_id, "sent", False, seconds=time.monotonic() - t0,
                                        error=f"{type(e).__name__}: {e}")  # fmt: skip
            self.post(result, waker)
        for s in sockets.values():
            s.close(linger=0)
        waker.close(linger=0)

    def _push(self, sockets: dict[str, zmq.Socket], job: _SendJob) -> tuple[int, int]:
        """Offer, then push what the receiver lacks; (blocks imported there, bytes sent)."""
        sock = sockets.get(job.target)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(self.config.timeout * 1000))  # no send blocks forever
            try:
                sock.connect(job.target)
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
            sockets[job.target] = sock
        tid = uuid.uuid4().hex
        deadline = time.monotonic() + self.config.timeout
        try:
            sock.send(msgspec.msgpack.encode(Offer(tid, job.payload.block_hashes)))
            have = self._reply(sock, tid, Have, deadline)
            payload = job.payload.tail(have.num_held)
            if payload.num_blocks == 0:
                return 0, 0
            meta = msgspec.structs.replace(payload, data=b"", scales=b"")
            blob_parts = (payload.data, payload.scales)
            if self.config.transport == "shm":
                size = payload.num_bytes
                shm = shared_memory.SharedMemory(create=True, size=max(size, 1))
                try:
                    shm.buf[: len(payload.data)] = payload.data
                    shm.buf[len(payload.data) : size] = payload.scales
                    sock.send(msgspec.msgpack.encode(Push(tid, meta, len(payload.data), shm.name)))
                    done = self._reply(sock, tid, Done, deadline)
                finally:  # the receiver copied it out (or gave up): the segment goes either way
                    shm.close()
                    shm.unlink()
            else:
                frames = [msgspec.msgpack.encode(Push(tid, meta, len(payload.data)))]
                for part in blob_parts:
                    view = memoryview(part)
                    frames += [view[i : i + CHUNK_BYTES] for i in range(0, len(view), CHUNK_BYTES)]
                sock.send_multipart(frames, copy=False)
                done = self._reply(sock, tid, Done, deadline)
        except (TimeoutError, zmq.ZMQError):
            # Replies that come late would answer the next offer: start that one on a fresh socket.
            sockets.pop(job.target, None)
            sock.close(linger=0)
            raise
        if not done.ok:
            raise RuntimeError(f"the decode worker refused the blocks: {done.error}")
        return done.num_imported, payload.num_bytes

    def _reply(self, sock: zmq.Socket, tid: str, kind: type, deadline: float):
        decoder = msgspec.msgpack.Decoder(WireMessage)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise TimeoutError(f"no answer from the decode worker within {self.config.timeout:.1f}s")
            msg = decoder.decode(sock.recv_multipart()[0])
            if msg.transfer_id != tid:
                continue  # an answer to an earlier, abandoned transfer
            if isinstance(msg, Done) and kind is Have:  # refused at the offer
                raise RuntimeError(f"the decode worker refused the offer: {msg.error}")
            if isinstance(msg, kind):
                return msg

    # -- decode side: Redis pulls ------------------------------------------------------

    def missing_prefix(self, block_hashes: list[BlockHash]) -> list[BlockHash]:
        """The hashes after the longest locally cached prefix (what a pull could fetch)."""
        if self.redis is None or self._has_block is None:
            return []
        i = 0
        while i < len(block_hashes) and self._has_block(block_hashes[i]):
            i += 1
        return block_hashes[i:]

    def pull(self, request_id: str, block_hashes: list[BlockHash], parent: BlockHash | None) -> None:
        self._pulls.put((request_id, block_hashes, parent))

    def _pull_loop(self) -> None:
        waker = self.waker()
        while not self._stop.is_set():
            try:
                request_id, hashes, parent = self._pulls.get(timeout=0.5)
            except queue.Empty:
                continue
            t0 = time.monotonic()
            try:
                payloads = self.redis.get_chain(hashes, parent)
                nbytes = sum(p.num_bytes for p in payloads)
                result = TransferResult(request_id, "received", True, len(payloads), nbytes, time.monotonic() - t0,
                                        payloads=payloads)  # fmt: skip
            except Exception as e:  # the request then computes its prompt here
                logger.warning("KV pull for %s failed: %s", request_id, e)
                result = TransferResult(request_id, "received", False, seconds=time.monotonic() - t0,
                                        error=f"{type(e).__name__}: {e}", payloads=[])  # fmt: skip
            self.post(result, waker)
        waker.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self.receiver is not None:
            self.receiver.stop()
        for t in self._threads:
            t.join(timeout=2.0)
        self.wake.close(linger=0)
        if self.redis is not None:
            self.redis.close()


class _Receiver:
    """The decode side's socket: answers offers, turns pushes into ImportJobs, sends Done."""

    def __init__(self, connector: KVConnector, host: str, port: int, max_payload_bytes: int) -> None:
        self.connector = connector
        self.replies: queue.Queue = queue.Queue()
        ctx = connector.ctx
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
            self._core_waker = self.connector.ctx.socket(zmq.PUSH)
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
        waker = self.connector.waker()
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
                    self.sock.send_multipart([identity, encoder.encode(done)])
                if self.sock not in ready:
                    continue
                frames = self.sock.recv_multipart(copy=False)
                identity = frames[0].bytes
                try:
                    msg = decoder.decode(frames[1].buffer)
                except (msgspec.DecodeError, IndexError) as e:
                    logger.warning("bad KV transfer message: %s", e)
                    continue
                if isinstance(msg, Offer):
                    held = 0
                    has = self.connector._has_block
                    while has is not None and held < len(msg.block_hashes) and has(msg.block_hashes[held]):
                        held += 1
                    self.sock.send_multipart([identity, encoder.encode(Have(msg.transfer_id, held))])
                elif isinstance(msg, Push):
                    self.connector.post(self._assemble(msg, frames[2:], identity), waker)
        finally:
            self.sock.close(linger=0)
            self.wake.close(linger=0)
            waker.close(linger=0)

    def _assemble(self, msg: Push, frames: list, identity: bytes) -> ImportJob:
        meta = msg.meta
        try:
            if msg.shm_name is not None:
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


class RedisBlockStore:
    """A Redis server as a shared KV-block store: key `ferry:kv:<namespace>:<hash hex>`, value one
    block's msgpack-encoded KVBlocks, written with SET NX EX ttl; the memory bound is the
    server's maxmemory with allkeys-lru eviction (set here when `max_memory` is given)."""

    def __init__(self, url: str, namespace: str, ttl: float, timeout: float, max_memory: str | None) -> None:
        import redis

        # No retries: a pull that fails leaves the request to compute its prompt, which beats waiting.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                           retry_on_timeout=False, retry=None)  # fmt: skip
        self.namespace = namespace
        self.ttl = max(1, int(ttl))
        self.decoder = msgspec.msgpack.Decoder(KVBlocks)
        if max_memory:
            self.client.config_set("maxmemory", max_memory)
            self.client.config_set("maxmemory-policy", "allkeys-lru")

    def key(self, block_hash: bytes) -> str:
        return f"ferry:kv:{self.namespace}:{block_hash.hex()}"

    def put(self, payload: KVBlocks) -> tuple[int, int]:
        """Store the blocks Redis lacks; (blocks written, bytes written)."""
        blocks = payload.split()
        if not blocks:
            return 0, 0
        keys = [self.key(b.block_hashes[0]) for b in blocks]
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        present = pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        written = nbytes = 0
        for block, k, there in zip(blocks, keys, present):
            if not there:
                value = msgspec.msgpack.encode(block)
                pipe.set(k, value, ex=self.ttl, nx=True)
                written += 1
                nbytes += len(value)
        pipe.execute()
        return written, nbytes

    def get_chain(self, hashes: list[bytes], parent: bytes | None) -> list[KVBlocks]:
        """The stored blocks of a chain, from its start up to the first one Redis lacks."""
        if not hashes:
            return []
        values = self.client.mget([self.key(h) for h in hashes])
        out = []
        for h, value in zip(hashes, values):
            if value is None:
                break
            block = self.decoder.decode(value)
            if block.block_hashes != [h] or block.parent_hash != parent:
                break  # a foreign or corrupt value: stop the chain here
            out.append(block)
            parent = h
        return out

    def close(self) -> None:
        self.client.close()
