"""`Authorization: Bearer <key>` checks, shared by `ferry serve --api-key` and the gateway's keys.

Keys are kept and compared as sha256 digests: every comparison has the same length, and every
configured key is compared, always, so the time taken says nothing about which key came close.
"""

from __future__ import annotations

import hashlib
import hmac


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer_digest(authorization: str | None) -> bytes | None:
    """The digest of the key an `Authorization: Bearer ...` header carries, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return key_digest(token.strip())


def match_digest(authorization: str | None, digests: list[bytes]) -> int | None:
    """The index of the configured key (by digest) the header carries, or None."""
    given = bearer_digest(authorization)
    if given is None:
        return None
    found = None
    for i, digest in enumerate(digests):  # all of them, always: constant time in the match's position
        if hmac.compare_digest(given, digest):
            found = i
    return found
