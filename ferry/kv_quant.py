"""The quantized KV-cache formats (`--kv-cache-dtype int8 | fp8 | fp8_e4m3`), in one place.

A quantized cache keeps the float caches' shape except for its last dimension: each (token,
KV head) row is `head_dim` quantized values followed by that row's fp32 scale (4 bytes), so a
layer's cache is still one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim + 4]
and its dtype says the format:

- `torch.int8`: symmetric, scale = absmax(row) / 127, value = round(x / scale) (half away from 0);
- `torch.float8_e4m3fn`: scale = absmax(row) / 448 (e4m3's largest finite value), value =
  fp8(x / scale) (round to nearest even).

The scale rides in the same bytes as its block, so everything that moves whole blocks (prefix
cache, PD export/import, copies) moves the scales too, and blocks travel quantized. The 4 extra
bytes per row are 6% of a head_dim 64 row (3% at 128): an int8 block is 0.53x a bf16 one.

torch has no `index_copy_` for float8 on the CPU: movers write through `as_bytes`.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)
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


def store_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [T, KVH, D] into the cache rows of `slots` (cache viewed as [slots, KVH, W]),
    quantizing when the cache is quantized, casting otherwise."""
    kvh, w = cache.shape[-2], cache.shape[-1]
    flat = cache.view(-1, kvh, w)
    if is_quantized(cache.dtype):
        flat.view(torch.uint8).index_copy_(0, slots, quantize_rows(x, cache.dtype).view(torch.uint8))
    else:
        flat.index_copy_(0, slots, x.to(cache.dtype))


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token over all layers, scales included."""
    return 2 * num_layers * num_kv_heads * row_bytes(head_dim, dtype)
