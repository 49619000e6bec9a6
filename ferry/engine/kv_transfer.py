"""Moving KV-cache blocks between engines by their prefix hashes (issue 5: prefill/decode).

The unit is a full block, named by its chained hash (engine/block_hash.py).
Export reads the blocks a prompt's hash chain names out of the prefix cache
(after a prefill the request's blocks stay cached, ref count 0, until
evicted), stopping at the first block no longer there. Import writes blocks
into free blocks of another engine and publishes them under the same hashes,
with ref count 0 (LRU tail): a request for that prompt added next finds them
as prefix-cache hits and computes only the rest (at most the last partial
block), exactly as if it had been prefilled there. Blocks the importer
already holds are skipped, and the exporter can be told which ones those are
(`skip`), so they are not sent again.

A payload is one msgspec struct with the raw bytes of the blocks' K and V for
every layer; it is checked against the importer's cache geometry before
anything is written.
"""

from __future__ import annotations

import msgspec
import torch

from ferry.engine.block_hash import BlockHash
from ferry.engine.kv_cache_manager import KVCacheManager


class KVBlocks(msgspec.Struct, array_like=True):
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name of the bytes, e.g. "float32"
    block_hashes: list[bytes]  # a chain, in prompt order
    parent_hash: bytes | None  # the parent of block_hashes[0] (None: the prompt's first block)
    data: bytes  # [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV dtype {name!r}")
    return dtype


def export_blocks(
    kv: KVCacheManager,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_hashes: list[BlockHash],
    skip: set[BlockHash] | frozenset = frozenset(),
) -> KVBlocks:
    """The cached blocks of a hash chain, from its start up to the first one not cached,
    leaving out the leading blocks in `skip` (the receiver holds them)."""
    k0 = kv_caches[0][0]
    _, block_size, kvh, d = k0.shape
    start = 0
    while start < len(block_hashes) and block_hashes[start] in skip:
        start += 1
    ids: list[int] = []
    hashes: list[bytes] = []
    for h in block_hashes[start:]:
        block = kv.pool.get_cached_block(h)
        if block is None:
            break
        ids.append(block.block_id)
        hashes.append(h)
    if ids:
        index = torch.tensor(ids, device=k0.device)
        # [layers, 2, n, bs, kvh, d] -> [n, layers, 2, bs, kvh, d]: one contiguous slab per block.
        stacked = torch.stack([torch.stack([k.index_select(0, index), v.index_select(0, index)]) for k, v in kv_caches])
        data = stacked.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        raw = data.view(torch.uint8).numpy().tobytes()
    else:
        raw = b""
    return KVBlocks(
        block_size=block_size,
        num_layers=len(kv_caches),
        num_kv_heads=kvh,
        head_dim=d,
        dtype=str(k0.dtype).removeprefix("torch."),
        block_hashes=hashes,
        parent_hash=block_hashes[start - 1] if start > 0 else None,
        data=raw,
    )


def import_blocks(kv: KVCacheManager, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], payload: KVBlocks) -> int:
    """Write the payload's blocks this engine lacks into free blocks and publish them in its
    prefix cache; returns how many were written. Raises ValueError, changing nothing, when the
    payload does not fit this cache (geometry, dtype, size) or free blocks run short."""
    k0 = kv_caches[0][0]
    _, block_size, kvh, d = k0.shape
    if (payload.block_size, payload.num_layers, payload.num_kv_heads, payload.head_dim) != (
        block_size, len(kv_caches), kvh, d):  # fmt: skip
        raise ValueError(
            f"KV blocks of shape (block {payload.block_size}, layers {payload.num_layers}, kv heads "
            f"{payload.num_kv_heads}, head dim {payload.head_dim}) do not fit this cache (block {block_size}, "
            f"layers {len(kv_caches)}, kv heads {kvh}, head dim {d})"
        )
    src_dtype = _dtype(payload.dtype)
    per_block = len(kv_caches) * 2 * block_size * kvh * d * src_dtype.itemsize
    if len(payload.data) != per_block * payload.num_blocks:
        raise ValueError(f"KV payload has {len(payload.data)} bytes, expected {per_block * payload.num_blocks}")
    if not kv.enable_prefix_caching:
        return 0  # nothing could find them
    wanted = [i for i, h in enumerate(payload.block_hashes) if kv.pool.get_cached_block(h) is None]
    if not wanted:
        return 0
    if len(wanted) > kv.pool.num_free_blocks:
        raise ValueError(f"no room for {len(wanted)} KV blocks ({kv.pool.num_free_blocks} free)")
    data = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8).view(src_dtype)
    data = data.view(payload.num_blocks, len(kv_caches), 2, block_size, kvh, d)
    blocks = kv.pool.allocate(len(wanted))
    index = torch.tensor([b.block_id for b in blocks], device=k0.device)
    rows = data[torch.tensor(wanted)].to(device=k0.device, dtype=k0.dtype)  # [n, layers, 2, bs, kvh, d]
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        k_cache.index_copy_(0, index, rows[:, layer, 0])
        v_cache.index_copy_(0, index, rows[:, layer, 1])
    for block, i in zip(blocks, wanted):
        parent = payload.block_hashes[i - 1] if i > 0 else payload.parent_hash
        kv.pool.cache_block(block, payload.block_hashes[i], parent)
    # Ref count 0, at the tail of the free queue (the chain's head last, so evicted last): cached,
    # and found by the next request for this prompt.
    kv.pool.free(list(reversed(blocks)))
    return len(wanted)
