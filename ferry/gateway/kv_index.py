"""Per-worker mirrors of the replicas' prefix caches, fed by their KV events.

A `KVEventSubscriber` per worker connects a SUB socket to the publisher that
`/ferry/info` names, then asks the replay socket for a snapshot and applies
batches newer than it. A batch whose sequence number skips ahead means some
were dropped (PUB does that to slow or late subscribers): the subscriber asks
for a replay from the first missing one, which returns the batches or, if they
have left the publisher's buffer, a fresh snapshot.

Hashes are chained (ferry/core/block_hash.py), so "block i of this prompt is
cached" implies its whole prefix is, and the overlap of a prompt with a worker
is the count of its leading block hashes the worker holds.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from ferry.core.kv_events import (
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ReplayRequest,
    ReplayResponse,
)
from ferry.gateway.background import BackgroundTask

logger = logging.getLogger(__name__)


PENDING_S = 10.0  # how long a routed prompt counts as cached before its events arrive


class KVIndex:
    """The block hashes one worker holds, as of event `seq`, plus the blocks of prompts the
    gateway just routed there whose events have not arrived yet ("pending"): without them, a
    tenant's second request, sent while its first is still in prefill, would see no overlap
    anywhere and could land on another replica."""

    def __init__(self, clock=time.monotonic) -> None:
        self.hashes: set[bytes] = set()
        self.seq = 0
        self.synced = False  # a snapshot has been applied
        self.clock = clock
        self.pending: dict[bytes, float] = {}  # hash -> until when it counts

    def add_pending(self, block_hashes: list[bytes]) -> None:
        now = self.clock()
        if len(self.pending) > 100_000:
            self.pending = {h: t for h, t in self.pending.items() if t > now}
        until = now + PENDING_S
        for h in block_hashes:
            if h not in self.hashes:
                self.pending[h] = until

    def apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                self.hashes.update(e.block_hashes)
                for h in e.block_hashes:
                    self.pending.pop(h, None)  # confirmed
            elif isinstance(e, BlockRemoved):
                self.hashes.difference_update(e.block_hashes)
                for h in e.block_hashes:
                    self.pending.pop(h, None)
            elif isinstance(e, AllBlocksCleared):
                self.hashes.clear()
                self.pending.clear()
        self.seq = batch.seq

    def reset(self, seq: int, hashes: list[bytes]) -> None:
        self.hashes = set(hashes)
        self.seq = seq
        self.synced = True

    def overlap(self, block_hashes: list[bytes]) -> int:
        """Leading blocks of a prompt this worker holds (or is about to)."""
        n = 0
        now = None
        for h in block_hashes:
            if h not in self.hashes:
                until = self.pending.get(h)
                if until is None:
                    break
                now = now if now is not None else self.clock()
                if until < now:
                    del self.pending[h]
                    break
            n += 1
        return n


class KVEventSubscriber(BackgroundTask):
    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, replay_port: int, name: str) -> None:
        super().__init__(f"kv events {name}")
        self.ctx, self.host, self.port, self.replay_port, self.name = ctx, host, port, replay_port, name
        self.index = KVIndex()
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.replay_decoder = msgspec.msgpack.Decoder(ReplayResponse)
        self.replays = 0  # how often a gap (or the start) needed the replay socket

    async def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.connect(f"tcp://{self.host}:{self.port}")
        try:
            await asyncio.sleep(0.1)  # let the subscription reach the publisher before the snapshot
            await self._resync(0)
            while True:
                if not await sub.poll(1000):
                    continue
                frames = await sub.recv_multipart()
                try:
                    batch = self.decoder.decode(frames[-1])
                except msgspec.DecodeError:
                    continue
                if batch.seq <= self.index.seq:
                    continue  # already in the snapshot or a replay
                if batch.seq > self.index.seq + 1:
                    await self._resync(self.index.seq + 1)
                    if batch.seq <= self.index.seq:
                        continue
                    if batch.seq > self.index.seq + 1:  # still a hole: start over from a snapshot
                        await self._resync(0)
                        continue
                self.index.apply(batch)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("KV event subscriber for %s failed; the worker is routed by load only", self.name)
            self.index.synced = False
        finally:
            sub.close()

    async def _resync(self, start_seq: int, timeout: float = 5.0) -> None:
        """Replay from start_seq (0: a snapshot); retried until the publisher answers."""
        self.replays += 1
        while True:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://{self.host}:{self.replay_port}")
            try:
                await dealer.send_multipart([b"", msgspec.msgpack.encode(ReplayRequest(start_seq))])
                if await dealer.poll(int(timeout * 1000)):
                    resp = self.replay_decoder.decode((await dealer.recv_multipart())[-1])
                    break
            finally:
                dealer.close()
            logger.warning("no KV-event replay from %s within %.0fs; retrying", self.name, timeout)
        if resp.snapshot is not None:
            self.index.reset(resp.snapshot.seq, resp.snapshot.block_hashes)
        for batch in resp.batches or []:
            if batch.seq == self.index.seq + 1:
                self.index.apply(batch)
