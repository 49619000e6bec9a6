"""Per-request KV blocks on top of the BlockPool: prefix lookup, allocation, freeing.

With a sliding window W (every layer windowed, as in Mistral), a block whose tokens all lie before
the next query's window is released while its request runs (vLLM's sliding-window manager): its
entry in the request's table becomes OUT_OF_WINDOW (block id 0, never read: attention gathers
from the window's first block), and the block goes back to the free queue, still in the prefix
cache until reused. A long request then holds about W tokens of KV, not its whole context.
"""

from __future__ import annotations

from ferry.core.block_pool import BlockPool, KVCacheBlock
from ferry.core.request import Request
from ferry.utils.math import cdiv

# The table entry of a block released because it fell out of the sliding window (not in the pool).
OUT_OF_WINDOW = KVCacheBlock(0, ref_cnt=-1)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        # The deployment's salt of every block hash (core/block_hash.py), set by a serving process
        # with a deployment secret; requests made for this cache hash with it.
        self.block_hash_salt: bytes | None = None
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # Prefix-cache counters, in tokens (as vLLM's prefix_cache_queries/hits).
        self.prefix_queries = 0
        self.prefix_hits = 0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request.

        At least one token is always left to compute: the last token's logits
        are needed, so a fully cached prompt gives up its last block.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def num_cached_prefix_tokens(self, request: Request) -> int:
        return self.get_computed_blocks(request)[1]

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        *,
        publish: bool = True,
        keep_free: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if blocks run out, or
        if fewer than `keep_free` would be left free.

        `new_computed_blocks` are prefix-cache hits for a request being
        scheduled for the first time; they are referenced, not copied.
        `publish=False`: blocks these tokens fill are not put in the prefix cache (yet): early
        exit's drafts write only the first layers' K/V before the step that schedules them.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        if self.sliding_window is not None:
            # No query from num_computed on sees the blocks before `end`: the held ones are released
            # (room for this step), and prefix hits among them are never taken.
            end = max(0, num_computed - self.sliding_window + 1) // self.block_size
            self._release_out_of_window(blocks, end)
            new_computed_blocks = [OUT_OF_WINDOW if len(blocks) + i < end else b
                                   for i, b in enumerate(new_computed_blocks)]  # fmt: skip
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hits on free blocks leave the free queue, so they use up free capacity too.
        hits_on_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(needed, 0) + hits_on_free + keep_free > self.pool.num_free_blocks:
            return False
        self.pool.touch([b for b in new_computed_blocks if b is not OUT_OF_WINDOW])
        blocks = blocks + new_computed_blocks
        if needed > 0:
            blocks += self.pool.allocate(needed)
        self.req_blocks[request.request_id] = blocks
        # Blocks that will be full once this step's tokens are written get published
        # now, so that a request scheduled later in this same step can share them.
        bs = self.block_size
        if publish:
            self._publish(request, blocks, num_computed // bs, (num_computed + num_new_tokens) // bs)
        return True

    def _release_out_of_window(self, blocks: list[KVCacheBlock], end: int) -> None:
        """Free the request's blocks before index `end`, all of whose tokens are out of every coming
        query's window (query i sees keys i - W < j <= i), oldest first."""
        released = []
        for i in range(min(end, len(blocks))):
            if blocks[i] is not OUT_OF_WINDOW:
                released.append(blocks[i])
                blocks[i] = OUT_OF_WINDOW
        if released:
            self.pool.free(released)

    def num_blocks_held(self, request_id: str) -> int:
        """The pool blocks a request references (its table minus entries released out of the window)."""
        return sum(1 for b in self.req_blocks.get(request_id, ()) if b is not OUT_OF_WINDOW)

    def _publish(self, request: Request, blocks: list[KVCacheBlock], first: int, end: int) -> None:
        """Put the request's blocks first..end-1 (as far as its tokens have hashes) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = request.block_hashes
        for i in range(first, min(end, len(hashes), len(blocks))):
            if blocks[i] is not OUT_OF_WINDOW:
                self.pool.cache_block(blocks[i], hashes[i], hashes[i - 1] if i else None)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix is evicted last."""
        blocks = self.req_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free([b for b in reversed(blocks) if b is not OUT_OF_WINDOW])

    def cache_verified_blocks(self, request: Request, first_position: int) -> None:
        """Publish the blocks that a speculative step filled with drafts the model then kept:
        `allocate_slots` could not (their hashes need the tokens, which were drafts then).
        `first_position`: the step's first token; the request's tokens are appended."""
        bs, blocks = self.block_size, self.req_blocks.get(request.request_id, [])
        self._publish(request, blocks, first_position // bs, request.num_computed_tokens // bs)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks the first `num_tokens` tokens occupy (a speculative step's
        rejected tail gives back the blocks it alone needed)."""
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks and len(blocks) > keep:
            self.req_blocks[request.request_id] = blocks[:keep]
            self.pool.free(list(reversed(blocks[keep:])))

    def blocks_short(self, requests: list[Request]) -> int:
        """Blocks these requests lack to hold the tokens they have (a decoding request at a block
        boundary lacks one for its next token; a prompt being prefilled, those of its chunks)."""
        bs = self.block_size
        return sum(max(0, cdiv(r.num_tokens, bs) - len(self.req_blocks.get(r.request_id, ()))) for r in requests)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def usage(self) -> float:
        return self.pool.usage()
