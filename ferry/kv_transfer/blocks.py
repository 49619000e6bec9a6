"""Moving KV-cache blocks between engines by their prefix hashes (issue 5: prefill/decode).

The unit is a full block, named by its chained hash (core/block_hash.py).
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
anything is written. In transit the bytes may be int8 (`encoding="int8"`):
symmetric, one fp32 scale per (block, layer, K/V, token, head), i.e. over a
head's `head_dim` values, which keeps the error at ~0.4% of each vector's
largest element while halving bf16 (quartering fp32) bytes.

A quantized cache (`--kv-cache-dtype int8 | fp8`, ferry/kv_quant.py) is sent as stored: its blocks
(values + scales, laid out by head) are the raw bytes, `dtype` names the format and `layout` the
block layout, nothing is requantized (an `int8` transit encoding is ignored for it), and an
importer whose cache has another dtype refuses the payload (both peers need the same
--kv-cache-dtype), as it refuses quantized blocks in another layout (a ferry from before the
layout sent rows and no `layout`; one that only knows rows rejects a payload with the field).
"""

from __future__ import annotations

import msgspec
import torch

from ferry.config import KV_ENCODINGS
from ferry.core.block_hash import BlockHash
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.kv_quant import BLOCK_LAYOUT, as_bytes, head_dim_of, is_quantized, row_width


class KVBlocks(msgspec.Struct, array_like=True):
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name of the bytes, e.g. "float32"; "int8" / "float8_e4m3fn": a quantized cache's rows
    block_hashes: list[bytes]  # a chain, in prompt order
    parent_hash: bytes | None  # the parent of block_hashes[0] (None: the prompt's first block)
    data: bytes  # [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim (+ 4: a quantized row's scale)]
    encoding: str = "raw"  # "raw": `dtype` values; "int8": int8 values + fp32 `scales`
    scales: bytes = b""  # int8: [num_blocks, num_layers, 2, block_size, num_kv_heads] float32
    layout: str = "rows"  # a quantized cache's block layout (kv_quant.BLOCK_LAYOUT); "rows": an older ferry's

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def num_bytes(self) -> int:
        return len(self.data) + len(self.scales)

    def shape(self) -> tuple[int, ...]:
        width = row_width(self.head_dim, _dtype(self.dtype))
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, width)

    def values(self) -> torch.Tensor:
        """The blocks as a tensor of `shape()`: floats (dequantized when in transit as int8), or a
        quantized cache's rows as stored."""
        if self.encoding == "raw":
            return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(_dtype(self.dtype)).view(self.shape())
        q = torch.frombuffer(bytearray(self.data), dtype=torch.int8).view(self.shape())
        scales = torch.frombuffer(bytearray(self.scales), dtype=torch.float32).view(self.shape()[:-1])
        return (q.float() * scales.unsqueeze(-1)).to(_dtype(self.dtype))

    def tail(self, k: int) -> "KVBlocks":
        """This payload without its first k blocks (the receiver holds them)."""
        n = self.num_blocks
        if k <= 0:
            return self
        k = min(k, n)
        step, sstep = len(self.data) // max(n, 1), len(self.scales) // max(n, 1)
        return KVBlocks(self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                        self.block_hashes[k:], self.block_hashes[k - 1], self.data[k * step:],
                        self.encoding if k < n else "raw", self.scales[k * sstep:], self.layout)  # fmt: skip

    def split(self) -> list["KVBlocks"]:
        """One payload per block (the unit a shared store keeps, keyed by its hash)."""
        out = []
        n = self.num_blocks
        step, sstep = len(self.data) // max(n, 1), len(self.scales) // max(n, 1)
        for i, h in enumerate(self.block_hashes):
            parent = self.block_hashes[i - 1] if i else self.parent_hash
            out.append(KVBlocks(self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, [h],
                                parent, self.data[i * step:(i + 1) * step], self.encoding,
                                self.scales[i * sstep:(i + 1) * sstep], self.layout))  # fmt: skip
        return out

    @staticmethod
    def join(parts: list["KVBlocks"]) -> "KVBlocks":
        """Consecutive single-chain payloads of one geometry and encoding as one payload."""
        first = parts[0]
        for prev, p in zip(parts, parts[1:]):
            if p.parent_hash != prev.block_hashes[-1]:
                raise ValueError("KV payloads to join are not one chain")
            if (p.encoding, p.dtype, p.layout, p.shape()[1:]) != (first.encoding, first.dtype, first.layout,
                                                                  first.shape()[1:]):  # fmt: skip
                raise ValueError("KV payloads to join differ in geometry or encoding")
        return KVBlocks(first.block_size, first.num_layers, first.num_kv_heads, first.head_dim, first.dtype,
                        [h for p in parts for h in p.block_hashes], first.parent_hash,
                        b"".join(p.data for p in parts), first.encoding,
                        b"".join(p.scales for p in parts), first.layout)  # fmt: skip


def quantize_int8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dimension: (int8 values, fp32 scales of shape values.shape[:-1])."""
    x = values.float()
    scales = x.abs().amax(dim=-1).clamp_min(1e-12) / 127.0
    q = torch.round(x / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scales


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype) and is_quantized(dtype):
        return dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize not in (2, 4):
        raise ValueError(f"unsupported KV dtype {name!r} (float32, bfloat16, float16, int8 or float8_e4m3fn)")
    return dtype


def export_blocks(
    kv: KVCacheManager,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_hashes: list[BlockHash],
    skip: set[BlockHash] | frozenset = frozenset(),
    encoding: str = "raw",
) -> KVBlocks:
    """The cached blocks of a hash chain, from its start up to the first one not cached,
    leaving out the leading blocks in `skip` (the receiver holds them)."""
    if encoding not in KV_ENCODINGS:
        raise ValueError(f"KV transfer encoding must be one of {KV_ENCODINGS}, got {encoding!r}")
    k0 = kv_caches[0][0]
    _, block_size, kvh, _ = k0.shape
    d = head_dim_of(k0)
    if is_quantized(k0.dtype):
        encoding = "raw"  # already int8 / fp8 with its scales: sent as stored
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
        # (A quantized cache is gathered as bytes: torch lacks some float8 ops on the CPU.)
        stacked = torch.stack([torch.stack([as_bytes(k).index_select(0, index), as_bytes(v).index_select(0, index)])
                               for k, v in kv_caches])  # fmt: skip
        data = stacked.permute(2, 0, 1, 3, 4, 5).contiguous()
        if encoding == "int8":
            q, sc = quantize_int8(data)
            raw, scales = q.cpu().numpy().tobytes(), sc.cpu().numpy().tobytes()
        else:
            raw, scales = data.cpu().view(torch.uint8).numpy().tobytes(), b""
    else:
        raw = scales = b""
    return KVBlocks(
        block_size=block_size,
        num_layers=len(kv_caches),
        num_kv_heads=kvh,
        head_dim=d,
        dtype=str(k0.dtype).removeprefix("torch."),
        block_hashes=hashes,
        parent_hash=block_hashes[start - 1] if start > 0 else None,
        data=raw,
        encoding=encoding if raw else "raw",
        scales=scales,
        layout=BLOCK_LAYOUT if is_quantized(k0.dtype) else "rows",
    )


def import_blocks(kv: KVCacheManager, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], payload: KVBlocks) -> int:
    """Write the payload's blocks this engine lacks into free blocks and publish them in its
    prefix cache; returns how many were written. Raises ValueError, changing nothing, when the
    payload does not fit this cache (geometry, dtype, size) or free blocks run short."""
    k0 = kv_caches[0][0]
    _, block_size, kvh, _ = k0.shape
    d = head_dim_of(k0)
    if (payload.block_size, payload.num_layers, payload.num_kv_heads, payload.head_dim) != (
        block_size, len(kv_caches), kvh, d):  # fmt: skip
        raise ValueError(
            f"KV blocks of shape (block {payload.block_size}, layers {payload.num_layers}, kv heads "
            f"{payload.num_kv_heads}, head dim {payload.head_dim}) do not fit this cache (block {block_size}, "
            f"layers {len(kv_caches)}, kv heads {kvh}, head dim {d})"
        )
    if len(set(payload.block_hashes)) != payload.num_blocks:
        raise ValueError("KV payload names a block twice")
    src_dtype = _dtype(payload.dtype)
    if payload.encoding not in KV_ENCODINGS:
        raise ValueError(f"unknown KV encoding {payload.encoding!r}")
    quantized = is_quantized(k0.dtype)
    if (quantized or is_quantized(src_dtype)) and src_dtype != k0.dtype:
        raise ValueError(
            f"KV blocks of dtype {payload.dtype} do not fit this {str(k0.dtype).removeprefix('torch.')} cache: "
            "quantized blocks move as stored, so both peers need the same --kv-cache-dtype"
        )
    if quantized and payload.encoding != "raw":
        raise ValueError(f"KV blocks of a quantized cache travel raw, got encoding {payload.encoding!r}")
    if quantized and payload.layout != BLOCK_LAYOUT:
        raise ValueError(
            f"quantized KV blocks laid out as {payload.layout!r} do not fit this cache's {BLOCK_LAYOUT!r} "
            "blocks (a peer from before the layout, kv_quant.py): both peers need the same ferry"
        )
    elements = len(kv_caches) * 2 * block_size * kvh * row_width(d, src_dtype) * payload.num_blocks
    itemsize = 1 if payload.encoding == "int8" else src_dtype.itemsize
    if len(payload.data) != elements * itemsize:
        raise ValueError(f"KV payload has {len(payload.data)} bytes, expected {elements * itemsize}")
    if payload.encoding == "int8" and len(payload.scales) != elements // d * 4:
        raise ValueError(f"KV payload has {len(payload.scales)} bytes of scales, expected {elements // d * 4}")
    if not kv.enable_prefix_caching:
        return 0  # nothing could find them
    wanted = [i for i, h in enumerate(payload.block_hashes) if kv.pool.get_cached_block(h) is None]
    if not wanted:
        return 0
    if len(wanted) > kv.pool.num_free_blocks:
        raise ValueError(f"no room for {len(wanted)} KV blocks ({kv.pool.num_free_blocks} free)")
    data = payload.values()
    blocks = kv.pool.allocate(len(wanted))
    index = torch.tensor([b.block_id for b in blocks], device=k0.device)
    if quantized:  # the bytes as stored (same dtype and layout, checked above)
        rows = data.view(torch.uint8)[torch.tensor(wanted)].to(k0.device)  # [n, layers, 2, bs, kvh, d + 4]
    else:
        rows = data[torch.tensor(wanted)].to(device=k0.device, dtype=k0.dtype)  # [n, layers, 2, bs, kvh, d]
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        as_bytes(k_cache).index_copy_(0, index, rows[:, layer, 0])
        as_bytes(v_cache).index_copy_(0, index, rows[:, layer, 1])
    for block, i in zip(blocks, wanted):
        parent = payload.block_hashes[i - 1] if i > 0 else payload.parent_hash
        kv.pool.cache_block(block, payload.block_hashes[i], parent)
    # Ref count 0, at the tail of the free queue (the chain's head last, so evicted last): cached,
    # and found by the next request for this prompt.
    kv.pool.free(list(reversed(blocks)))
    return len(wanted)
