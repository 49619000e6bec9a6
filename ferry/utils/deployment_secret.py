"""The deployment's secret (`--kv-transfer-secret-file`, `FERRY_KV_TRANSFER_SECRET`) and what it proves.

One secret, shared by a deployment's workers and gateway, keys everything that
crosses a KV port: KV-transfer messages (kv_transfer/), KV-event batches and
replays (core/kv_events.py), Redis values (kv_transfer/redis_store.py), and the
salt of every block hash (core/block_hash.py), each under its own derived key.

Anyone who can reach a decode worker's receiver could otherwise push KV blocks
under any hash, and every later request whose prompt hashes the same would
read them. With a deployment secret, every message either way carries two more
frames: a stamp (wall-clock nanoseconds and a random nonce) and
HMAC-SHA256(secret, every frame length-prefixed, then the stamp). A message
without them, with a wrong MAC, older than the window, or whose nonce was seen
already (a replay) is dropped before it is decoded. The stamp uses wall time,
so the hosts of one deployment keep their clocks within the window (NTP).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import struct
import time

logger = logging.getLogger(__name__)

_STAMP = struct.Struct("<Q16s")  # time.time_ns(), nonce
_DOMAIN = b"ferry-kv-auth-v1"


def warn_if_unsealed(what: str, host: str, secret: bytes | None) -> bool:
    """Warn (and say so) when a KV port listens beyond loopback with no secret: anyone who reaches it
    can then push blocks under hashes they compute themselves (a receiver), or learn which prompts a
    replica holds (the events). Loopback-only ports reach only this host's processes."""
    if secret:
        return False
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name, or ZMQ's "*": reachable from elsewhere
        loopback = False
    if not loopback:
        logger.warning("%s listens on %s without a deployment secret: anyone who can reach it is trusted "
                       "(set --kv-transfer-secret-file or FERRY_KV_TRANSFER_SECRET on every worker and the gateway)",
                       what, host)  # fmt: skip
    return not loopback


class AuthError(ValueError):
    """A message that does not prove it comes from a holder of the deployment's secret."""


class MessageAuth:
    """Seals outgoing and opens incoming multipart messages; one instance per socket thread (its
    record of seen nonces is not shared)."""

    def __init__(self, secret: bytes | None, window_s: float = 60.0) -> None:
        self.secret = secret or None
        self.window_ns = int(window_s * 1e9)
        self._seen: dict[bytes, int] = {}  # nonce -> its stamp, for the window
        self._prune_at = 4096  # prune the expired nonces when this many are kept (amortised O(1))

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def seal(self, frames: list) -> list:
        if self.secret is None:
            return frames
        stamp = _STAMP.pack(time.time_ns(), os.urandom(16))
        return [*frames, stamp, self._mac(frames, stamp)]

    def open(self, frames: list) -> list:
        """The message's own frames, or AuthError. `frames`: bytes, memoryviews or zmq Frames."""
        if self.secret is None:
            return frames
        if len(frames) < 3:
            raise AuthError("an unauthenticated message (this receiver needs the deployment's secret)")
        *body, stamp, mac = frames
        stamp, mac = _bytes(stamp), _bytes(mac)
        if len(stamp) != _STAMP.size or not hmac.compare_digest(mac, self._mac(body, stamp)):
            raise AuthError("a message with a wrong MAC (another secret, or altered on the way)")
        sent_ns, nonce = _STAMP.unpack(stamp)
        now = time.time_ns()
        if abs(now - sent_ns) > self.window_ns:
            raise AuthError(f"a message stamped {(now - sent_ns) / 1e9:.0f} s away from now (a replay, or clock skew)")
        if nonce in self._seen:
            raise AuthError("a replayed message")
        self._seen[nonce] = sent_ns
        if len(self._seen) > self._prune_at:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= self.window_ns}
            self._prune_at = max(4096, 2 * len(self._seen))
        return body

    def _mac(self, frames: list, stamp: bytes) -> bytes:
        h = hmac.new(self.secret, _DOMAIN, hashlib.sha256)
        for f in frames:
            view = _view(f)
            h.update(len(view).to_bytes(8, "little"))
            h.update(view)
        h.update(stamp)
        return h.digest()


def _view(frame) -> memoryview:
    buf = getattr(frame, "buffer", None)  # a zmq.Frame
    return memoryview(buf if buf is not None else frame).cast("B")


def _bytes(frame) -> bytes:
    return bytes(_view(frame))


def derive_key(secret: bytes, purpose: bytes) -> bytes:
    """A 32-byte key for one use of the secret, so no two uses share a key."""
    return hmac.new(secret, purpose, hashlib.sha256).digest()


def block_hash_salt(secret: bytes | None) -> bytes | None:
    """The deployment salt of every block hash (core/block_hash.py), or None without a secret."""
    return derive_key(secret, b"ferry-block-hash-salt")[:16] if secret else None


def load_secret(path: str | None) -> bytes | None:
    """The deployment's KV secret: the file's contents (stripped), else $FERRY_KV_TRANSFER_SECRET, else None."""
    if path:
        with open(path, "rb") as f:
            secret = f.read().strip()
        if len(secret) < 16:
            raise ValueError(f"{path}: a KV-transfer secret needs at least 16 bytes")
        return secret
    env = os.environ.get("FERRY_KV_TRANSFER_SECRET", "").strip()
    if env and len(env) < 16:
        raise ValueError("FERRY_KV_TRANSFER_SECRET needs at least 16 characters")
    return env.encode() or None
