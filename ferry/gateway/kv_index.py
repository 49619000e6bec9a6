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

`KVMirrors` keeps one live subscriber per reachable worker that publishes
events (kv-aware policy only) and answers the overlap questions the router
asks; a worker without a live, synced mirror is routed by load alone.

With the deployment's secret (`--kv-transfer-secret-file`), the gateway hashes
prompts with the deployment's salt, as its workers do, and takes only batches
and replay replies that carry the secret's HMAC (core/kv_events.py). A worker
whose `/ferry/info` names another salt (or none) is routed by load alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from urllib.parse import urlparse

import msgspec
import zmq
import zmq.asyncio

from ferry.core.block_hash import hash_prompt_blocks, lora_hash_key, lora_name_fingerprint, salt_fingerprint
from ferry.core.kv_events import (
    HASH_ALGORITHM,
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ReplayRequest,
    ReplayResponse,
)
from ferry.gateway.background import BackgroundTask
from ferry.gateway.replicas import Worker
from ferry.utils.deployment_secret import AuthError, MessageAuth, block_hash_salt

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
    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, replay_port: int, name: str,
                 secret: bytes | None = None) -> None:  # fmt: skip
        super().__init__(f"kv events {name}")
        self.ctx, self.host, self.port, self.replay_port, self.name = ctx, host, port, replay_port, name
        self.auth = MessageAuth(secret)
        self.refused = 0  # messages without a valid MAC, dropped
        self.index = KVIndex()
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.replay_decoder = msgspec.msgpack.Decoder(ReplayResponse)
        self.replays = 0  # how often a gap (or the start) needed the replay socket
        self.info: dict | None = None  # the worker's /ferry/info that named these ports

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
                    batch = self.decoder.decode(self.auth.open(frames)[-1])
                except AuthError as e:
                    self._refuse(e)
                    continue
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
                await dealer.send_multipart(self.auth.seal([b"", msgspec.msgpack.encode(ReplayRequest(start_seq))]))
                if await dealer.poll(int(timeout * 1000)):
                    try:
                        resp = self.replay_decoder.decode(self.auth.open(await dealer.recv_multipart())[-1])
                        break
                    except AuthError as e:
                        self._refuse(e)
                        await asyncio.sleep(timeout)  # not our publisher: ask again, slowly
                        continue
            finally:
                dealer.close()
            logger.warning("no KV-event replay from %s within %.0fs; retrying", self.name, timeout)
        if resp.snapshot is not None:
            self.index.reset(resp.snapshot.seq, resp.snapshot.block_hashes)
        for batch in resp.batches or []:
            if batch.seq == self.index.seq + 1:
                self.index.apply(batch)

    def _refuse(self, error: AuthError) -> None:
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            logger.warning("KV events from %s: dropped %d message(s) without this deployment's MAC (%s)",
                           self.name, self.refused, error)  # fmt: skip


class KVMirrors(BackgroundTask):
    """One live KVEventSubscriber per reachable worker that publishes KV events (when `subscribe`:
    the kv-aware policy), kept so by a loop every `interval` seconds; a worker that goes away
    loses its mirror and `forget(url)` is called for it (it may come back with an empty cache)."""

    def __init__(self, workers: list[Worker], interval: float, subscribe: bool,
                 forget: Callable[[str], None], secret: bytes | None = None) -> None:  # fmt: skip
        super().__init__("kv subscribers")
        self.workers, self.interval, self.subscribe, self.forget = workers, interval, subscribe, forget
        self.secret = secret
        self.hash_salt = block_hash_salt(secret)  # as the workers of this deployment salt their hashes
        self.salt_fingerprint = salt_fingerprint(self.hash_salt)
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._zmq: zmq.asyncio.Context | None = None

    def start(self) -> None:
        self._zmq = zmq.asyncio.Context()
        super().start()

    async def stop(self) -> None:
        await super().stop()
        for s in self.subscribers.values():
            await s.stop()
        if self._zmq is not None:
            self._zmq.term()

    def block_hashes(self, token_ids: list[int], block_size: int, cache_salt: str | None,
                     model: str | None = None, worker: Worker | None = None) -> list[bytes]:  # fmt: skip
        """A prompt's block hashes as this deployment's workers compute them; for a request whose
        `model` is a LoRA adapter of `worker` (its /ferry/info), as that adapter's requests hash them.
        None of them ([]: routed by load) for a model `worker`'s /ferry/info does not name as its own
        and gives no adapter digest for (not described yet, or not a ferry serve): the base model's
        hashes would credit blocks the adapter cannot use."""
        lora_key = None
        if worker is not None and model:
            info = worker.info or {}
            if model not in (info.get("models") or ()):
                digest = (info.get("lora_digests") or {}).get(lora_name_fingerprint(model))
                if not isinstance(digest, str):
                    return []
                lora_key = lora_hash_key(model, digest)
        return hash_prompt_blocks(token_ids, block_size, cache_salt, self.hash_salt, lora_key)

    def overlap(self, worker: Worker, hashes: list[bytes]) -> int:
        """Leading blocks of a prompt `worker` caches, as far as its mirror knows."""
        if not self.mirrored(worker):
            return 0  # no live mirror of this worker's cache: route it by load
        return self.subscribers[worker.url].index.overlap(hashes)

    def add_pending(self, worker: Worker, hashes: list[bytes]) -> None:
        """A prompt was just sent to `worker`: count its blocks as cached there until events confirm them."""
        sub = self.subscribers.get(worker.url)
        if hashes and sub is not None:
            sub.index.add_pending(hashes)

    def blocks_known(self, worker: Worker) -> int | None:
        sub = self.subscribers.get(worker.url)
        return len(sub.index.hashes) if sub is not None else None

    def mirrored(self, worker: Worker) -> bool:
        """Whether `worker`'s cache has a live, synced mirror here (else it is routed by load alone)."""
        sub = self.subscribers.get(worker.url)
        return sub is not None and sub.index.synced and sub.running

    async def _run(self) -> None:
        warned: set[str] = set()
        while True:
            for w in self.workers:
                try:
                    await self._sync(w, warned)
                except Exception:  # one worker's odd /ferry/info must not stop the others' sync
                    logger.exception("KV-event subscriber for %s", w.url)
            await asyncio.sleep(self.interval)

    async def _sync(self, w: Worker, warned: set[str]) -> None:
        sub = self.subscribers.get(w.url)
        restarted = sub is not None and sub.info is not w.info  # read again: a restart (replicas.py)
        if sub is not None and (not w.reachable or not sub.running or restarted):
            await sub.stop()  # gone, failed or restarted: a new one starts from a fresh snapshot
            del self.subscribers[w.url]
            sub = None
            if restarted:
                self.forget(w.url)
        if not w.reachable:
            self.forget(w.url)
            w.info = None  # refetched on recovery: a restarted worker has new ports
            return
        if sub is None and self.subscribe and w.info and w.info.get("kv_events"):
            if w.info.get("block_hash") != HASH_ALGORITHM:
                if w.url not in warned:
                    warned.add(w.url)
                    logger.warning("worker %s hashes blocks with %s, not %s: routed by load", w.url,
                                   w.info.get("block_hash"), HASH_ALGORITHM)  # fmt: skip
                return
            if w.info.get("block_hash_salt") != self.salt_fingerprint:
                if w.url not in warned:
                    warned.add(w.url)
                    logger.warning("worker %s salts block hashes %s, this gateway %s (--kv-transfer-secret-file or "
                                   "$FERRY_KV_TRANSFER_SECRET differ): routed by load", w.url,
                                   w.info.get("block_hash_salt") or "not at all",
                                   self.salt_fingerprint or "not at all")  # fmt: skip
                return
            ev = w.info["kv_events"]
            host = ev["host"]
            if host in ("0.0.0.0", "*", "::", ""):
                host = urlparse(w.url).hostname or "127.0.0.1"
            if ":" in host and not host.startswith("["):
                host = f"[{host}]"  # IPv6 in a tcp:// endpoint
            sub = KVEventSubscriber(self._zmq, host, int(ev["port"]), int(ev["replay_port"]), w.url, self.secret)
            sub.info = w.info  # the ports it was made from
            sub.start()
            self.subscribers[w.url] = sub
