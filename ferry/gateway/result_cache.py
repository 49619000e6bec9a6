"""Exact-match cache of deterministic responses: a hit touches no worker.

Only requests whose output is a function of the body are cached: temperature 0
(greedy) or a fixed `seed` (a seeded request's tokens do not depend on the
batch it runs in, worker/sampler.py). The key is the API key's name, the
endpoint and the body as canonical JSON (sorted keys), so a streamed and a
non-streamed request are different entries and each is replayed in its own
form, byte for byte. Only complete 200 responses are stored. Bounded by
entries and bytes (LRU) and by a TTL; `x-ferry-cache: skip` on a request
bypasses it (no lookup, no store).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from ferry.gateway.response_usage import sse_events


@dataclass
class CachedResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    worker: str
    stored_at: float
    usage: tuple[int | None, int | None] = (None, None)  # (prompt, completion) tokens: what a hit is charged


def is_deterministic(data: dict) -> bool:
    temperature = data.get("temperature", 1.0)  # OpenAI's default samples
    if data.get("seed") is not None and isinstance(data.get("seed"), int):
        return True
    return isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature == 0


def cache_key(path: str, data: dict, key_name: str) -> str | None:
    """Per API key: one tenant's responses are never replayed to another (nor is their existence
    revealed by a hit's speed). None: the body cannot be written out again and is not cached. A body
    the decoder took near its depth limit (~1000 levels, counted on the Python stack) can be too deep
    to encode from the handler's deeper stack: json.dumps' RecursionError there was a 500."""
    try:
        canonical = msgspec.json.encode(data, order="sorted")
    except (RecursionError, TypeError, ValueError):
        return None
    return hashlib.sha256(f"{key_name}\n{path}\n".encode() + canonical).hexdigest()


class ResultCache:
    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 << 20, ttl: float = 600.0,
                 clock=time.monotonic) -> None:  # fmt: skip
        if max_entries < 1 or max_bytes < 1 or ttl <= 0:
            raise ValueError("result cache bounds must be positive")
        self.max_entries, self.max_bytes, self.ttl, self.clock = max_entries, max_bytes, ttl, clock
        self._entries: OrderedDict[str, CachedResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CachedResponse | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self.clock() - entry.stored_at > self.ttl:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: str, status: int, headers: dict[str, str], body: bytes, worker: str,
            usage: tuple[int | None, int | None] = (None, None)) -> bool:  # fmt: skip
        """Store a complete response; False if it alone is over the byte bound."""
        if len(body) > self.max_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        self._entries[key] = CachedResponse(status, headers, body, worker, self.clock(), usage)
        self.bytes += len(body)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self.bytes -= len(entry.body)


def with_answer_id(body: bytes, streamed: bool, request_id: str | None) -> bytes:
    """A replayed body under an id of its own. The stored answer's `id` (`<prefix>-<id>`; every chunk
    of a stream repeats it) becomes `<prefix>-<request_id>`, the client's X-Request-Id as a worker
    would name it, or a fresh random one: a hit must not hand one client the trace id another sent
    (every client shares the cache of a gateway without keys), nor give every hit the same id."""
    try:
        first = next(iter(sse_events(body)), None) if streamed else json.loads(body)
    except ValueError:
        return body
    if isinstance(first, dict) and "id" not in first and isinstance(first.get("response"), dict):
        first = first["response"]  # a Responses API stream: its events carry the response
    old = first.get("id") if isinstance(first, dict) else None
    if not isinstance(old, str) or "-" not in old:
        return body
    new = f"{old.split('-', 1)[0]}-{request_id or uuid.uuid4().hex}"
    field = re.compile(rb'("id"\s*:\s*)' + re.escape(msgspec.json.encode(old)))
    return field.sub(lambda m: m.group(1) + msgspec.json.encode(new), body)
