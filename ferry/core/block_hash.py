"""Stable, chained hashes of full KV blocks for prefix caching.

h_i = sha256(h_{i-1} || token ids of block i as little-endian uint32 || extras)

Never Python's `hash()`: it is salted per process, and the gateway and every
replica must compute the same value for the same tokens.
"""

from __future__ import annotations

import hashlib
import struct

BlockHash = bytes

_ROOT = b"ferry-kv-v1"


def hash_block_tokens(parent: BlockHash | None, token_ids: list[int], extras: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extras:
        h.update(b"\x00extras")
        h.update(extras)
    return h.digest()[:16]


def hash_prompt_blocks(token_ids: list[int], block_size: int, extras: bytes = b"") -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (what a router needs)."""
    out: list[BlockHash] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extras)
        out.append(parent)
    return out
