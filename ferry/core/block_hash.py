"""Stable, chained hashes of full KV blocks for prefix caching.

h_0 = sha256(root || token ids of block 0 as little-endian uint32)
h_i = sha256(h_{i-1} || token ids of block i as little-endian uint32)

The root is fixed, or derived from a request's `cache_salt` (vLLM's field): a
salted prompt's blocks hash differently from the same tokens under another salt
or none, so prefix-cache hits, and what they reveal through timing,
`cached_tokens` and KV events, happen only among requests holding the salt.
A request run under a LoRA adapter (layers/lora.py) computes other K/V for the
same tokens: the adapter's key (its name and its files' digest) is mixed into the root too.

A deployment with a secret (utils/deployment_secret.py) also mixes a salt
derived from it into every root: hashes leave a worker in KV events, KV-transfer
offers and Redis keys, and without the salt anyone could hash candidate prompts
and test which of them a replica holds. Its gateway holds the same secret, so it
computes the same hashes for routing; `/ferry/info` names the salt by a
fingerprint (`salt_fingerprint`) that tells a mismatch without revealing it.

Never Python's `hash()`: it is salted per process, and the gateway and every
replica must compute the same value for the same tokens.
"""

from __future__ import annotations

import hashlib
import struct

BlockHash = bytes

_ROOT = b"ferry-kv-v1"


def chain_root(cache_salt: str | None = None, deployment_salt: bytes | None = None,
               lora_key: str | None = None) -> bytes:  # fmt: skip
    """The parent of a prompt's first block."""
    root = _ROOT
    if deployment_salt:
        root = hashlib.sha256(root + b"\x00deployment\x00" + deployment_salt).digest()[:16]
    if cache_salt:
        root = hashlib.sha256(root + b"\x00cache_salt\x00" + cache_salt.encode("utf-8", "surrogatepass")).digest()[:16]
    if lora_key:
        root = hashlib.sha256(root + b"\x00lora\x00" + lora_key.encode("utf-8", "surrogatepass")).digest()[:16]
    return root


def lora_name_fingerprint(name: str) -> str:
    """A public name for a LoRA adapter's name (`/ferry/info` lists adapters' digests under it): a
    gateway holding a request's model name finds its adapter's digest; nobody else learns the name."""
    return hashlib.sha256(b"ferry-lora-name\x00" + name.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def lora_hash_key(name: str, digest: str) -> str:
    """What a LoRA adapter's prompts mix into their block hashes: its name and its files' digest."""
    return f"{name}:{digest}"


def salt_fingerprint(deployment_salt: bytes | None) -> str | None:
    """A public name for a deployment salt: equal salts, equal names; the name does not give the salt."""
    if not deployment_salt:
        return None
    return hashlib.sha256(b"ferry-block-hash-salt-fingerprint\x00" + deployment_salt).hexdigest()[:16]


def hash_block_tokens(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """`parent`: the previous block's hash, or for the first block `chain_root(...)` (None: unsalted)."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()[:16]


def hash_prompt_blocks(token_ids: list[int], block_size: int, cache_salt: str | None = None,
                       deployment_salt: bytes | None = None,
                       lora_key: str | None = None) -> list[BlockHash]:  # fmt: skip
    """Hashes of every full block of `token_ids` (what a router needs)."""
    out: list[BlockHash] = []
    parent = chain_root(cache_salt, deployment_salt, lora_key)
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
