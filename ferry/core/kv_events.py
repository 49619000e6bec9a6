"""KV-cache events: what a replica's prefix cache gained and lost, for the gateway's router.

The BlockPool records an event whenever a full block is published under its
hash (`BlockStored`, chained blocks of one request merged into one event with
the parent of the first), whenever a cached block is reused for other content
(`BlockRemoved`, LRU eviction) and when the whole cache is reset
(`AllBlocksCleared`). The EngineCore process publishes each step's events as
one `KVEventBatch` with a sequence number on a ZMQ PUB socket (msgspec).

PUB drops what a subscriber was not connected for, so a subscriber tracks the
sequence numbers and asks the replay socket (ROUTER) for what it missed: the
batches themselves while they are still in the publisher's ring buffer, or
else a snapshot of every hash the cache holds now (with the sequence number it
is current as of). A new subscriber starts from a snapshot.

Hashes are ferry/core/block_hash.py's chained sha256 (16 bytes), which the
gateway recomputes from a prompt's tokens.

With the deployment's secret (utils/deployment_secret.py), batches, replay
requests and replies carry a stamp and an HMAC: a subscriber takes events only
from its deployment's publisher, and the publisher answers replays (a snapshot
costs it a walk over the cache) only to its deployment's subscribers. The
frames are not encrypted: anyone who can reach the PUB port reads the hashes,
which is why a deployment with a secret also salts them (core/block_hash.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from ferry.config import KVEventsConfig
from ferry.core.block_hash import BlockHash
from ferry.utils.deployment_secret import AuthError, MessageAuth, warn_if_unsealed

HASH_ALGORITHM = "sha256-chained-v1"  # names ferry/core/block_hash.py's scheme
TOPIC = b"kv"


class BlockStored(msgspec.Struct, tag="stored", array_like=True):
    block_hashes: list[bytes]  # a chain: each block's parent is the one before it
    parent_block_hash: bytes | None  # the parent of block_hashes[0]; None for a prompt's first block


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True):
    block_hashes: list[bytes]


class AllBlocksCleared(msgspec.Struct, tag="cleared", array_like=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    seq: int  # 1, 2, 3, ... per publisher
    timestamp: float  # time.time()
    events: list[KVEvent]


class ReplayRequest(msgspec.Struct, array_like=True):
    start_seq: int  # the first batch wanted; < 1 asks for a snapshot


class KVSnapshot(msgspec.Struct, array_like=True):
    seq: int  # the snapshot includes every batch up to and including this one
    block_hashes: list[bytes]


class ReplayResponse(msgspec.Struct, array_like=True):
    batches: list[KVEventBatch] | None = None  # the batches from start_seq on, if still buffered
    snapshot: KVSnapshot | None = None  # otherwise the whole current state


class KVEventRecorder:
    """The BlockPool's event list for the current step."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def stored(self, block_hash: BlockHash, parent: BlockHash | None) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)  # the next block of the same chain
        else:
            self.events.append(BlockStored([block_hash], parent))

    def removed(self, block_hash: BlockHash) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events = [AllBlocksCleared()]  # earlier events of the step no longer matter

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


class KVEventPublisher:
    """PUB socket for batches, ROUTER socket for replays; lives in the EngineCore process."""

    def __init__(self, ctx: zmq.Context, config: KVEventsConfig) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.port = _bind(self.pub, config.host, config.port)
        self.replay_port = _bind(self.replay, config.host, config.replay_port)
        self.host = config.host
        warn_if_unsealed(f"the KV-event publisher (ports {self.port}, {self.replay_port})", config.host, config.secret)
        self.seq = 0
        self.buffer: deque[KVEventBatch] = deque(maxlen=max(1, config.buffer_steps))
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ReplayRequest)
        self.auth = MessageAuth(config.secret)  # this (the core's) thread's: seals batches and replies
        self.refused_replays = 0  # replay requests without a valid MAC, dropped

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        batch = KVEventBatch(self.seq, time.time(), events)
        self.buffer.append(batch)
        try:
            self.pub.send_multipart(self.auth.seal([TOPIC, self.encoder.encode(batch)]), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a subscriber that cannot keep up sees a gap and asks for a replay

    def serve_replays(self, snapshot: Callable[[], list[bytes]], max_requests: int = 1_000_000) -> None:
        """Answer up to `max_requests` pending replay requests without blocking (busy loop)."""
        for _ in range(max_requests):
            if not self.replay.poll(0):
                return
            frames = self.replay.recv_multipart()
            identity = frames[0]
            try:
                req = self.decoder.decode(self.auth.open(frames[1:])[-1])
            except AuthError:
                self.refused_replays += 1
                continue  # not from this deployment: not worth a snapshot
            except (msgspec.DecodeError, IndexError):
                continue  # not ours; never let a stray client disturb the engine
            oldest = self.buffer[0].seq if self.buffer else self.seq + 1
            if req.start_seq >= 1 and req.start_seq >= oldest:
                resp = ReplayResponse(batches=[b for b in self.buffer if b.seq >= req.start_seq])
            elif req.start_seq > self.seq:
                resp = ReplayResponse(batches=[])
            else:
                resp = ReplayResponse(snapshot=KVSnapshot(self.seq, snapshot()))
            try:
                reply = self.auth.seal([b"", self.encoder.encode(resp)])
                self.replay.send_multipart([identity, *reply], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        self.pub.close()
        self.replay.close()


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")
