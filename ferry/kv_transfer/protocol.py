"""The messages of a KV transfer between a prefill worker's sender and a decode worker's
receiver (ZMQ DEALER/ROUTER, msgspec). The outcome the EngineCore reports to its API process is
outcome.py's.

tcp and shm: the sender offers a hash chain (`Offer`), the receiver answers how many leading
blocks it already holds (`Have`; `Done` with an error when the offer is of another model or
cache), the sender pushes the rest (`Push`: the payload's metadata and size, or the name of a
shared-memory segment), tcp then sends the bytes as `Chunk` messages of at most CHUNK_BYTES, and
the receiver's core imports them and answers `Done`.

Every chunk is a message of its own, not a frame of the push: ZMQ holds a multipart message
whole before delivering it and bounds only each frame's size (MAXMSGSIZE), so a push of many
frames could fill memory before the receiver saw a byte of it. Separate messages are each
bounded, and the receiver counts them against the size the push announced.
"""

from __future__ import annotations

import msgspec

from ferry.kv_transfer.blocks import KVBlocks

CHUNK_BYTES = 4 << 20


class Offer(msgspec.Struct, tag="offer", array_like=True):
    transfer_id: str
    block_hashes: list[bytes]
    # The sender's model and cache (connector.cache_fingerprint): a receiver of another refuses the
    # offer, as blocks hashed from the same tokens by another model (a fine-tune of the same shape)
    # would import cleanly and decode from the wrong KV. "" from a ferry before the field: refused.
    fingerprint: str = ""


class Have(msgspec.Struct, tag="have", array_like=True):
    transfer_id: str
    num_held: int  # leading blocks of the offer the receiver caches already
    # shm: the segment the sender must create for this transfer. The receiver names it, so a peer can
    # never make it open another process's segment.
    shm_name: str | None = None


class Push(msgspec.Struct, tag="push", array_like=True):
    transfer_id: str
    meta: KVBlocks  # data and scales empty: they follow as Chunks, or in shared memory
    data_bytes: int
    shm_name: str | None = None  # shm: the segment holding data then scales (Have.shm_name)
    total_bytes: int = 0  # tcp: data then scales, in Chunks


class Chunk(msgspec.Struct, tag="chunk", array_like=True):
    """tcp: the next bytes of a push (its data, then its scales), in a frame after this one."""

    transfer_id: str
    offset: int  # where these bytes start: each chunk follows the one before


class Done(msgspec.Struct, tag="done", array_like=True):
    transfer_id: str
    ok: bool
    num_imported: int = 0
    error: str | None = None


WireMessage = Offer | Have | Push | Chunk | Done
