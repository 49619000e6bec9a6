"""The pool of KV-cache blocks: ref counts, the free queue and the prefix-cache map.

A block whose ref count drops to 0 keeps its hash (and its K/V) and joins the
tail of the free queue. Allocation takes from the head, so the least recently
freed cached block is evicted first (LRU); a cache hit on a free block pulls it
out of the queue. Invariant: free + referenced == num_blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ferry.core.block_hash import BlockHash
from ferry.core.kv_events import KVEventRecorder


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (head = next to be reused).
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        # KV events for the gateway (kv_events.py); None, and free, unless enabled.
        self.events: KVEventRecorder | None = None

    def enable_events(self) -> None:
        self.events = KVEventRecorder()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue from head (next evicted) to tail."""
        return list(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the head of the free queue, evicting their cached contents."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; the caller passes them in eviction order."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, parent: BlockHash | None = None) -> None:
        """Publish a full block under its hash (first writer wins on duplicates); `parent` is the
        hash of the block before it in its sequence (None for the first), for KV events."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # the same content is already cached in another block
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent)

    def num_referenced(self) -> int:
        return sum(1 for b in self.blocks if b.ref_cnt > 0)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is referenced."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True
