"""The quantized KV-cache formats (`--kv-cache-dtype int8 | fp8 | fp8_e4m3`), in one place.

Each (token, KV head) row is `head_dim` quantized values and that row's fp32 scale (4 bytes):

- `torch.int8`: symmetric, scale = absmax(row) / 127, value = round(x / scale) (half away from 0);
- `torch.float8_e4m3fn`: scale = absmax(row) / 448 (e4m3's largest finite value), value =
  fp8(x / scale) (round to nearest even).

A layer's cache keeps the float caches' shape except for its last dimension, one K and one V
tensor of [num_blocks, block_size, kv_heads, head_dim + 4] whose dtype says the format, but the
bytes of a block are laid out for the decode kernels rather than row by row. Head h's part of a
block is block_size * (head_dim + 4) consecutive bytes: its values, then its block_size scales
(fp32, in token order). The values:

- K (`KEYS`): [head_dim / 2][block_size][2]: for each pair of dimensions, every token's two values
  side by side, token after token. The CPU decode kernel dots 16 keys at once, one key per 32-bit
  lane (a block's pair p of 16 keys is one 32-byte load), where rows made it add up 16 lanes per key.
- V (`VALUES`): [block_size / 2][head_dim][2]: tokens 2j and 2j + 1's value d side by side, so one
  int16 multiply-add weights two tokens' values at once, with no shuffle to pair them.
- MLA's latent cache (one tensor, read as both): `ROWS`, [block_size][kv_heads][head_dim + 4].

Every reader and writer goes through this layout (here for torch; ferry/kernels/csrc/kv_layout.h for
the C++ kernels; the Triton kernels' offsets), so the block_size of a quantized cache must be even.
Everything that moves whole blocks (prefix cache, PD export/import, copies) moves the scales too,
and blocks travel quantized and laid out as stored. The 4 extra bytes per row are 6% of a head_dim
64 row (3% at 128): an int8 block is 0.53x a bf16 one.

torch has no `index_copy_` for float8 on the CPU: movers write through `as_bytes`.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)
# How a quantized cache's blocks are laid out (the module's docstring): K, V, or MLA's rows.
KEYS, VALUES, ROWS = "keys", "values", "rows"
# Their numbers in the C++ kernels (KvLayout, ferry/kernels/csrc/kv_layout.h).
LAYOUT_IDS = {ROWS: 0, KEYS: 1, VALUES: 2}
# The name PD payloads and the shared store's namespace give this block layout: an earlier ferry
# stored quantized blocks row by row, and a peer that did must not have its blocks read as these.
BLOCK_LAYOUT = "heads"
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# --kv-cache-dtype names of the quantized formats (fp8 is e4m3, as in vLLM).
KV_FORMAT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_KV_DTYPES


def qmax(dtype: torch.dtype) -> float:
    return _QMAX[dtype]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, head) row of the cache tensor."""
    if is_quantized(dtype):
        if head_dim % 4:
            raise ValueError(f"a quantized KV cache needs head_dim divisible by 4, got {head_dim}")
        return head_dim + SCALE_BYTES
    return head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    return row_width(head_dim, dtype) * dtype.itemsize


def head_dim_of(cache: torch.Tensor) -> int:
    """The model's head_dim from a cache tensor (its last dimension less the scale, if quantized)."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache.dtype) else 0)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a 1-byte cache (for index_copy_), the tensor itself otherwise."""
    return cache.view(torch.uint8) if is_quantized(cache.dtype) else cache


def scales_of(cache: torch.Tensor) -> torch.Tensor:
    """The fp32 scales of a quantized cache (or a slice of its rows): a view, shape [..., 1]."""
    d = head_dim_of(cache)
    return cache.view(torch.uint8)[..., d:].view(torch.float32)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [..., D] float -> packed rows [..., D + 4] of `dtype` (values, then the fp32 scale)."""
    x = x.float()
    d = x.shape[-1]
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / qmax(dtype)
    y = x / scale
    if dtype == torch.int8:
        q = torch.trunc(y + torch.copysign(torch.full_like(y, 0.5), y)).clamp_(-127, 127).to(torch.int8)
    else:
        q = y.clamp_(-448.0, 448.0).to(dtype)
    packed = torch.empty(*x.shape[:-1], d + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    packed[..., :d] = q.view(torch.uint8)
    packed[..., d:] = scale.view(torch.uint8)
    return packed.view(dtype)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows [..., D + 4] -> [..., D] of `dtype`."""
    d = head_dim_of(packed)
    return (packed[..., :d].float() * scales_of(packed)).to(dtype)


def _laid_out(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized cache's values and scales as views: KEYS [NB, KVH, D/2, BS, 2] and VALUES [NB, KVH,
    BS/2, D, 2] uint8, scales [NB, KVH, BS] fp32."""
    nb, bs, kvh, w = cache.shape
    if bs % 2:
        raise ValueError(f"a quantized KV cache needs an even block size, got {bs}")
    d = w - SCALE_BYTES
    heads = cache.view(torch.uint8).view(nb, kvh, bs * w)
    values = heads[..., : d * bs]
    scales = heads[..., d * bs :].view(torch.float32)
    if layout == KEYS:
        return values.unflatten(-1, (d // 2, bs, 2)), scales
    if layout == VALUES:
        return values.unflatten(-1, (bs // 2, d, 2)), scales
    raise ValueError(f"unknown quantized KV layout {layout!r}")


def rows_of_blocks(blocks: torch.Tensor, layout: str) -> torch.Tensor:
    """Whole blocks [n, BS, KVH, W] of a cache as rows (each token's D values, then its scale), a copy;
    float caches and ROWS are already rows."""
    if not is_quantized(blocks.dtype) or layout == ROWS:
        return blocks
    n, bs, kvh, w = blocks.shape
    d = w - SCALE_BYTES
    values, scales = _laid_out(blocks, layout)
    if layout == KEYS:  # [n, KVH, D/2, BS, 2] -> [n, BS, KVH, D/2, 2]
        values = values.permute(0, 3, 1, 2, 4).reshape(n, bs, kvh, d)
    else:  # [n, KVH, BS/2, D, 2] -> [n, BS/2, 2, KVH, D]
        values = values.permute(0, 2, 4, 1, 3).reshape(n, bs, kvh, d)
    scale_bytes = scales.permute(0, 2, 1).contiguous().view(torch.uint8).view(n, bs, kvh, SCALE_BYTES)
    return torch.cat([values, scale_bytes], dim=-1).view(blocks.dtype)


def blocks_of_rows(rows: torch.Tensor, layout: str) -> torch.Tensor:
    """rows_of_blocks' inverse: blocks given as rows [n, BS, KVH, W] laid out as a cache stores them."""
    if not is_quantized(rows.dtype) or layout == ROWS:
        return rows
    n, bs, kvh, w = rows.shape
    d = w - SCALE_BYTES
    out = torch.empty_like(rows)
    values, scales = _laid_out(out, layout)
    src = rows.view(torch.uint8)
    if layout == KEYS:
        values.copy_(src[..., :d].reshape(n, bs, kvh, d // 2, 2).permute(0, 2, 3, 1, 4))
    else:
        values.copy_(src[..., :d].reshape(n, bs // 2, 2, kvh, d).permute(0, 3, 1, 4, 2))
    scales.copy_(src[..., d:].contiguous().view(torch.float32).view(n, bs, kvh).permute(0, 2, 1))
    return out


def quantize_blocks(x: torch.Tensor, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """x [NB, BS, KVH, D] float -> a cache of those blocks, quantized and laid out as `layout`."""
    return blocks_of_rows(quantize_rows(x, dtype), layout)


def _check_slots(slots: torch.Tensor, num_slots: int) -> None:
    """The block layout finds a slot's bytes by arithmetic (slot // block_size), where a negative or
    too large slot would name another block: refused, as index_copy_ / index_select refuse them."""
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise IndexError(f"KV cache slots must be in [0, {num_slots}), got {slots.min()}..{slots.max()}")


def rows_at(cache: torch.Tensor, slots: torch.Tensor, layout: str) -> torch.Tensor:
    """The rows [len(slots), KVH, W] of a cache's slots (slot = block * block_size + position), as
    quantize_rows packs them; for a float cache or ROWS, an index_select of them."""
    nb, bs, kvh, w = cache.shape
    if not is_quantized(cache.dtype) or layout == ROWS:
        return cache.view(-1, kvh, w).index_select(0, slots)
    _check_slots(slots, nb * bs)
    values, scales = _laid_out(cache, layout)
    block, pos = slots // bs, slots % bs
    if layout == KEYS:
        vals = values[block, :, :, pos, :].flatten(-2)  # [n, KVH, D/2, 2] -> [n, KVH, D]
    else:
        vals = values[block, :, pos // 2, :, pos % 2]  # [n, KVH, D]
    scale_bytes = scales[block, :, pos].view(torch.uint8)  # [n, KVH * 4]
    return torch.cat([vals, scale_bytes.view(len(slots), kvh, SCALE_BYTES)], dim=-1).view(cache.dtype)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, layout: str) -> None:
    """Write x [T, KVH, D] into the cache rows of `slots` (cache viewed as [slots, KVH, W]),
    quantizing when the cache is quantized (laid out as `layout`), casting otherwise."""
    nb, bs, kvh, w = cache.shape
    if not is_quantized(cache.dtype):
        cache.view(-1, kvh, w).index_copy_(0, slots, x.to(cache.dtype))
        return
    _put_rows(cache, slots, quantize_rows(x, cache.dtype).view(torch.uint8), layout)


def _put_rows(cache: torch.Tensor, slots: torch.Tensor, packed: torch.Tensor, layout: str) -> None:
    """Packed rows [T, KVH, W] (uint8: values, then the scale) into a quantized cache's `slots`."""
    nb, bs, kvh, w = cache.shape
    if layout == ROWS:
        cache.view(torch.uint8).view(-1, kvh, w).index_copy_(0, slots, packed)
        return
    d = w - SCALE_BYTES
    _check_slots(slots, nb * bs)
    values, scales = _laid_out(cache, layout)
    block, pos = slots // bs, slots % bs
    if layout == KEYS:
        values[block, :, :, pos, :] = packed[..., :d].unflatten(-1, (d // 2, 2))
    else:
        values[block, :, pos // 2, :, pos % 2] = packed[..., :d]
    scales[block, :, pos] = packed[..., d:].contiguous().view(torch.float32).view(len(slots), kvh)


def copy_slots(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, layout: str) -> None:
    """Slot src[i]'s K or V rows (every head) to slot dst[i], as stored: a quantized row moves with its
    scale, nothing requantized (tree verification moving the drafts it kept). A quantized cache's
    slots are not rows of its tensor (the block layout above): a copy of cache.view(-1, KVH, W)'s rows
    moved pieces of several tokens' values and scales."""
    if not is_quantized(cache.dtype) or layout == ROWS:
        flat = as_bytes(cache).flatten(0, 1)  # [slots, KVH, W]
        flat.index_copy_(0, dst, flat.index_select(0, src))
        return
    _put_rows(cache, dst, rows_at(cache, src, layout).view(torch.uint8), layout)


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token over all layers, scales included."""
    return 2 * num_layers * num_kv_heads * row_bytes(head_dim, dtype)
