"""A Redis server as the KV-block store shared by every worker (`--redis-url`, `--kv-transfer redis`).

Anyone who can write to that Redis could store blocks under any hash for
later prompts to read. With the deployment's secret (`--kv-transfer-secret-file`,
`FERRY_KV_TRANSFER_SECRET`) every value is sealed: a version tag and
HMAC-SHA256(a key derived from the secret, the Redis key + the value), so a
value moved to another key or written without the secret is ignored (the
chain stops there and the prompt's remaining blocks are computed). Redis's
own AUTH and TLS come with the URL: `redis://:password@host:port/db`,
`rediss://...` (redis-py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging

import msgspec

from ferry.kv_transfer.blocks import KVBlocks
from ferry.utils.deployment_secret import derive_key

logger = logging.getLogger(__name__)
_SEALED = b"ferry-kv-v1:"  # then a 32-byte MAC, then the msgpack value


class RedisBlockStore:
    """A Redis server as a shared KV-block store: key `ferry:kv:<namespace>:<hash hex>`, value one
    block's msgpack-encoded KVBlocks, written with SET NX EX ttl; the memory bound is the
    server's maxmemory with allkeys-lru eviction (set here when `max_memory` is given)."""

    def __init__(self, url: str, namespace: str, ttl: float, timeout: float, max_memory: str | None,
                 secret: bytes | None = None) -> None:  # fmt: skip
        import redis

        self._mac_key = derive_key(secret, b"ferry-kv-redis-values") if secret else None

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
                value = self._seal(k, msgspec.msgpack.encode(block))
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
            body = self._open(self.key(h), value)
            try:
                block = self.decoder.decode(body) if body is not None else None
            except msgspec.DecodeError:
                block = None
            if block is None or block.block_hashes != [h] or block.parent_hash != parent:
                logger.warning("Redis holds a foreign or corrupt value under %s; not used", self.key(h))
                break  # stop the chain here: the rest of the prompt is computed
            out.append(block)
            parent = h
        return out

    def _mac(self, key: str, body: bytes) -> bytes:
        return hmac.new(self._mac_key, key.encode() + b"\0" + body, hashlib.sha256).digest()

    def _seal(self, key: str, body: bytes) -> bytes:
        return body if self._mac_key is None else _SEALED + self._mac(key, body) + body

    def _open(self, key: str, value: bytes) -> bytes | None:
        """The value's msgpack body, or None when it is not sealed with this deployment's secret."""
        if self._mac_key is None:
            return value
        if not value.startswith(_SEALED) or len(value) < len(_SEALED) + 32:
            return None
        mac, body = value[len(_SEALED) : len(_SEALED) + 32], value[len(_SEALED) + 32 :]
        return body if hmac.compare_digest(mac, self._mac(key, body)) else None

    def close(self) -> None:
        self.client.close()
