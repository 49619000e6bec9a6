"""A Redis server as the KV-block store shared by every worker (`--redis-url`, `--kv-transfer redis`)."""

from __future__ import annotations

import msgspec

from ferry.kv_transfer.blocks import KVBlocks


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
