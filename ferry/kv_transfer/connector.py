"""The KV connector: moves a request's KV blocks between engine cores (prefill/decode disaggregation).

It lives in the EngineCore process, beside the cache it reads and writes, and
never blocks the busy loop: sockets and Redis are served by threads, and
everything that touches the block pool or the cache tensors runs on the core
thread when the loop drains what the threads post (core_channel.py: they
wake it through an inproc socket the loop polls with its other sockets).

Roles and transports (`ferry serve --role ... --kv-transfer ...`):
- A prefill worker finishes a request that asked for remote decode
  (`EngineCoreRequest.kv_export`), then exports the prompt's full blocks
  (blocks.py) and a sender thread pushes them:
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
receiver (imports are all-or-nothing, blocks.py) and the sender always
releases its buffer or segment. The outcome reaches the API process as a
`KVTransferDone` message.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import shared_memory

import msgspec
import zmq

from ferry.config import KVTransferConfig
from ferry.core.block_hash import BlockHash
from ferry.kv_transfer.blocks import KVBlocks
from ferry.kv_transfer.core_channel import CoreChannel
from ferry.kv_transfer.outcome import KVTransferDone
from ferry.kv_transfer.protocol import CHUNK_BYTES, Chunk, Done, Have, Offer, Push, WireMessage
from ferry.kv_transfer.receiver import Receiver
from ferry.kv_transfer.redis_store import RedisBlockStore
from ferry.utils.deployment_secret import AuthError, MessageAuth

logger = logging.getLogger("ferry.kv_transfer")


def cache_fingerprint(namespace: str) -> str:
    """A short public name for a worker's model and cache geometry (the coordinator's namespace):
    equal for peers whose blocks fit each other, without sending the model's path to a peer."""
    return hashlib.sha256(b"ferry-kv-cache\0" + namespace.encode()).hexdigest()[:16]


@dataclass
class TransferResult:
    """A finished send (prefill side) or pull (decode side): its outcome for the API process and,
    for a pull, the blocks the core imports before the parked request runs."""

    outcome: KVTransferDone
    payloads: list[KVBlocks] | None = None


@dataclass
class _SendJob:
    request_id: str
    payload: KVBlocks
    target: str | None  # tcp://host:port of a receiver (tcp, shm); None for redis
    queued_at: float = field(default_factory=time.monotonic)


# Sends go out in lanes, one per receiver, each with its own thread: a receiver that does not answer
# holds up only the transfers bound for it (each for up to --kv-transfer-timeout), where one queue
# for all made every other decode worker's transfers wait behind it and fail. Receivers past this
# many at once share one lane; a lane's thread ends after LANE_IDLE_S without work.
MAX_SEND_LANES = 32
LANE_IDLE_S = 30.0
_SHARED_LANE = ""


@dataclass
class _SendLane:
    jobs: queue.Queue = field(default_factory=queue.Queue)
    # The lane thread's own (ZMQ sockets belong to one thread): a socket per receiver, and the
    # auth that seals its offers and pushes and opens the replies.
    sockets: dict[str, zmq.Socket] = field(default_factory=dict)
    auth: MessageAuth | None = None


class KVConnector:
    def __init__(
        self,
        config: KVTransferConfig,
        ctx: zmq.Context,
        namespace: str,
        max_payload_bytes: int,
        has_block: Callable[[BlockHash], bool],
    ) -> None:
        """`has_block(hash)`: whether the core's prefix cache holds a block (read from threads: a
        dict lookup, atomic under the GIL; a block evicted right after is merely recomputed)."""
        config.validate()
        self.config = config
        self.ctx = ctx
        self.namespace = namespace  # Redis keys: model and cache geometry
        self.fingerprint = cache_fingerprint(namespace)  # the same, in tcp and shm offers
        self.has_block = has_block
        self.channel = CoreChannel(ctx)
        self.receiver: Receiver | None = None
        self.receiver_addr: str | None = None
        self.redis = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        if config.redis_url:
            self.redis = RedisBlockStore(config.redis_url, namespace, config.redis_ttl, config.timeout,
                                         config.redis_max_memory, config.secret)  # fmt: skip
        self._lanes: dict[str, _SendLane] = {}  # receiver address (or _SHARED_LANE) -> its lane
        self._lanes_lock = threading.Lock()
        self._lanes_started = 0  # names the lanes' threads
        self._pulls: queue.Queue = queue.Queue()
        if self.redis is not None:
            self._start(self._pull_loop, "ferry-kv-puller")
        if config.receives:
            self.receiver = Receiver(self.channel, config.host, config.port, max_payload_bytes, has_block,
                                     self.fingerprint, config.secret, config.timeout)  # fmt: skip
            self.receiver_addr = self.receiver.addr
            self._start(self.receiver.run, "ferry-kv-receiver")

    def _start(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads = [*(u for u in self._threads if u.is_alive()), t]  # lanes' threads come and go

    @property
    def wake(self) -> zmq.Socket:
        return self.channel.wake

    def drain(self) -> list:
        """On the core thread: ImportJobs and TransferResults the threads posted since the last call."""
        return self.channel.drain()

    # -- prefill side ------------------------------------------------------------------

    def send(self, request_id: str, payload: KVBlocks, target: str | None) -> None:
        """Queue a send; its TransferResult comes back through `drain`."""
        if self.config.transport is None:
            failed = KVTransferDone(request_id, "sent", False, error="this worker has no --kv-transfer")
            self.channel.put(TransferResult(failed))
        elif self.config.transport != "redis" and not target:
            failed = KVTransferDone(request_id, "sent", False, error="no decode worker address to send to")
            self.channel.put(TransferResult(failed))
        else:
            self._enqueue(_SendJob(request_id, payload, target))

    def _enqueue(self, job: _SendJob) -> None:
        """Into its receiver's lane, starting the lane (and its thread) if it has none."""
        with self._lanes_lock:
            key = job.target or _SHARED_LANE
            if key not in self._lanes and len(self._lanes) >= MAX_SEND_LANES:
                key = _SHARED_LANE
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _SendLane()
                self._lanes_started += 1
                self._start(lambda: self._send_loop(key, lane), f"ferry-kv-sender-{self._lanes_started}")
            lane.jobs.put(job)

    def _send_loop(self, key: str, lane: _SendLane) -> None:
        waker = None
        try:
            lane.auth = MessageAuth(self.config.secret)
            waker = self.channel.waker()
            self._send_jobs(key, lane, waker)
        except Exception:  # a bug, or the process out of sockets: reported below, not silent
            logger.exception("the KV sender for %s stopped", key or "the shared lane")
        finally:  # whatever happened: an open socket would keep the context from terminating
            for s in lane.sockets.values():
                s.close(linger=0)
            if waker is not None:
                waker.close(linger=0)
            self._retire(key, lane)

    def _retire(self, key: str, lane: _SendLane) -> None:
        """A lane whose thread has stopped takes no more jobs, and the ones it holds fail at once
        (the API process answers them without a transfer) rather than wait for a thread that is gone."""
        with self._lanes_lock:
            if self._lanes.get(key) is lane:
                del self._lanes[key]
        if self._stop.is_set():
            return
        failed = []
        while True:
            try:
                job: _SendJob = lane.jobs.get_nowait()
            except queue.Empty:
                break
            failed.append(TransferResult(KVTransferDone(job.request_id, "sent", False, error="the KV sender stopped")))
        if not failed:
            return
        try:
            waker = self.channel.waker()
        except zmq.ZMQError:  # out of sockets: the core sees them at its next drain
            for result in failed:
                self.channel.put(result)
            return
        try:
            for result in failed:
                self.channel.post(result, waker)
        finally:
            waker.close(linger=0)

    def _send_jobs(self, key: str, lane: _SendLane, waker: zmq.Socket) -> None:
        idle_since = time.monotonic()
        while not self._stop.is_set():
            try:
                job: _SendJob = lane.jobs.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() - idle_since < LANE_IDLE_S:
                    continue
                with self._lanes_lock:  # nothing can be queued here while this holds the lock
                    if lane.jobs.empty():
                        del self._lanes[key]
                        return
                continue
            t0 = time.monotonic()
            try:
                if t0 - job.queued_at > 2 * self.config.timeout:  # its API request has given up waiting
                    raise TimeoutError(f"waited {t0 - job.queued_at:.1f}s behind other transfers in its lane")
                if self.config.transport == "redis":
                    n, nbytes = self.redis.put(job.payload)
                else:
                    n, nbytes = self._push(lane, job)
                result = TransferResult(KVTransferDone(job.request_id, "sent", True, n, nbytes, time.monotonic() - t0))
            except Exception as e:  # reported to the API process, which answers without the transfer
                logger.warning("KV transfer of %s failed: %s", job.request_id, e)
                result = TransferResult(
                    KVTransferDone(
                        job.request_id, "sent", False, seconds=time.monotonic() - t0, error=f"{type(e).__name__}: {e}"
                    )
                )
            if self._stop.is_set():  # closing: the channel may be gone
                return
            self.channel.post(result, waker)
            idle_since = time.monotonic()

    def _push(self, lane: _SendLane, job: _SendJob) -> tuple[int, int]:
        """Offer, then push what the receiver lacks; (blocks imported there, bytes sent)."""
        sockets, auth = lane.sockets, lane.auth
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
            sock.send_multipart(
                auth.seal([msgspec.msgpack.encode(Offer(tid, job.payload.block_hashes, self.fingerprint))])
            )
            have = self._reply(sock, tid, Have, deadline, auth)
            payload = job.payload.tail(have.num_held)
            if payload.num_blocks == 0:
                return 0, 0
            meta = msgspec.structs.replace(payload, data=b"", scales=b"")
            blob_parts = (payload.data, payload.scales)
            if self.config.transport == "shm":
                size = payload.num_bytes
                if not have.shm_name:
                    raise RuntimeError("the decode worker named no shared-memory segment")
                shm = shared_memory.SharedMemory(name=have.shm_name, create=True, size=max(size, 1))
                try:
                    shm.buf[: len(payload.data)] = payload.data
                    shm.buf[len(payload.data) : size] = payload.scales
                    push = Push(tid, meta, len(payload.data), shm.name)
                    sock.send_multipart(auth.seal([msgspec.msgpack.encode(push)]))
                    done = self._reply(sock, tid, Done, deadline, auth)
                finally:  # the receiver copied it out (or gave up): the segment goes either way
                    shm.close()
                    shm.unlink()
            else:  # the push, then each chunk as a message of its own (protocol.py says why)
                push = Push(tid, meta, len(payload.data), total_bytes=payload.num_bytes)
                sock.send_multipart(auth.seal([msgspec.msgpack.encode(push)]))
                offset = 0
                for part in blob_parts:
                    view = memoryview(part)
                    for i in range(0, len(view), CHUNK_BYTES):
                        if self._stop.is_set() or time.monotonic() > deadline:  # closing, or out of time
                            raise TimeoutError(f"the push did not finish within {self.config.timeout:.1f}s")
                        chunk = view[i : i + CHUNK_BYTES]
                        header = msgspec.msgpack.encode(Chunk(tid, offset))
                        sock.send_multipart(auth.seal([header, chunk]), copy=False)
                        offset += len(chunk)
                done = self._reply(sock, tid, Done, deadline, auth)
        except (TimeoutError, zmq.ZMQError):
            # Replies that come late would answer the next offer: start that one on a fresh socket.
            sockets.pop(job.target, None)
            sock.close(linger=0)
            raise
        if not done.ok:
            raise RuntimeError(f"the decode worker refused the blocks: {done.error}")
        return done.num_imported, payload.num_bytes

    def _reply(self, sock: zmq.Socket, tid: str, kind: type, deadline: float, auth: MessageAuth):
        decoder = msgspec.msgpack.Decoder(WireMessage)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise TimeoutError(f"no answer from the decode worker within {self.config.timeout:.1f}s")
            try:
                msg = decoder.decode(auth.open(sock.recv_multipart())[0])
            except (AuthError, msgspec.DecodeError, IndexError) as e:
                logger.warning("KV transfer reply refused: %s", e)
                continue
            if msg.transfer_id != tid:
                continue  # an answer to an earlier, abandoned transfer
            if isinstance(msg, Done) and kind is Have:  # refused at the offer
                raise RuntimeError(f"the decode worker refused the offer: {msg.error}")
            if isinstance(msg, kind):
                return msg

    # -- decode side: Redis pulls ------------------------------------------------------

    def missing_prefix(self, block_hashes: list[BlockHash]) -> list[BlockHash]:
        """The hashes after the longest locally cached prefix (what a pull could fetch)."""
        if self.redis is None:
            return []
        i = 0
        while i < len(block_hashes) and self.has_block(block_hashes[i]):
            i += 1
        return block_hashes[i:]

    def pull(self, request_id: str, block_hashes: list[BlockHash], parent: BlockHash | None) -> None:
        self._pulls.put((request_id, block_hashes, parent))

    def _pull_loop(self) -> None:
        waker = self.channel.waker()
        while not self._stop.is_set():
            try:
                request_id, hashes, parent = self._pulls.get(timeout=0.5)
            except queue.Empty:
                continue
            t0 = time.monotonic()
            try:
                payloads = self.redis.get_chain(hashes, parent)
                nbytes = sum(p.num_bytes for p in payloads)
                done = KVTransferDone(request_id, "received", True, len(payloads), nbytes, time.monotonic() - t0)
                result = TransferResult(done, payloads)
            except Exception as e:  # the request then computes its prompt here
                logger.warning("KV pull for %s failed: %s", request_id, e)
                done = KVTransferDone(
                    request_id, "received", False, seconds=time.monotonic() - t0, error=f"{type(e).__name__}: {e}"
                )
                result = TransferResult(done, payloads=[])
            self.channel.post(result, waker)
        waker.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self.receiver is not None:
            self.receiver.stop()
        end = time.monotonic() + self.config.timeout + 2.0  # a sender may be inside a transfer: its timeout
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        self.channel.close()
        if self.redis is not None:
            self.redis.close()
