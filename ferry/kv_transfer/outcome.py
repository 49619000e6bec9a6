"""What the EngineCore tells its API process about one request's KV transfer.

A module of its own, free of torch: the API process imports it (engine/messages.py) and never
loads torch, while protocol.py's wire messages carry blocks.py's payload, which needs it.
"""

from __future__ import annotations

import msgspec


class KVTransferDone(msgspec.Struct, tag="kv", array_like=True):
    """A KV transfer finished (EngineCore -> API process): `sent` (prefill side, for request_id),
    `received` (decode side: pushed blocks imported, or a Redis pull for request_id)."""

    request_id: str
    direction: str  # "sent" | "received"
    ok: bool
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
