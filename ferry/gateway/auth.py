"""API keys for the gateway (`--api-keys FILE`).

The file is either one key per line (blank lines and `#` comments ignored),
or JSON: a list of objects
    {"key": "sk-...", "name": "team-a",
     "prompt_tokens_per_minute": 20000, "completion_tokens_per_minute": 5000,
     "total_tokens_per_minute": 22000, "prefill_pool": "team-a",
     "priority": -1, "admin": false}
where every field but "key" is optional (no limit when absent; "prefill_pool":
with disaggregated serving, the pool of `--prefill team-a=URL` workers that
prefill this key's requests, which all share the decode pool; "priority": the
scheduling priority of this key's requests, lower first, as vLLM's, the
client's own being dropped; "admin": the key may read `/metrics` and
`/gateway/workers`, as `--admin-key` may). Clients send
`Authorization: Bearer <key>`. Keys are compared in constant time against
every configured key (no early exit, so the time does not say which key came
close), and never logged: logs and metrics name a key by its "name" (default:
"key-<n>", its position in the file).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ferry.utils.bearer import key_digest, match_digest


@dataclass(frozen=True)
class KeyLimits:
    prompt_tokens_per_minute: int | None = None
    completion_tokens_per_minute: int | None = None
    total_tokens_per_minute: int | None = None


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes  # sha256 of the key: compared, and kept instead of the key itself
    limits: KeyLimits
    prefill_pool: str | None = None  # disaggregated serving: the prefill pool this key's requests use
    priority: int = 0  # set on every request of this key (the client's own is dropped)
    admin: bool = False  # may read /metrics, /gateway/workers and /gateway/state (the dashboard)

    @property
    def cache_salt(self) -> str:
        """This key's prefix-cache partition (core/block_hash.py): derived from the key, so only its
        holder (and the operator) could compute it, and stable across gateway restarts and replicas."""
        return hashlib.sha256(b"ferry-cache-salt\x00" + self.digest).hexdigest()[:32]


class ApiKeys:
    def __init__(self, keys: list[tuple]) -> None:
        """`keys`: (name, key, limits[, prefill pool[, priority[, admin]]])."""
        if not keys:
            raise ValueError("the API key file has no keys")
        names = [k[0] for k in keys]
        if len(set(names)) != len(names):
            raise ValueError("API key names must be unique")
        if len({k[1] for k in keys}) != len(keys):
            raise ValueError("the API key file lists a key twice")
        self.keys = [ApiKey(k[0], key_digest(k[1]), *k[2:]) for k in keys]

    @classmethod
    def from_file(cls, path: str) -> "ApiKeys":
        with open(path, encoding="utf-8") as f:
            text = f.read()
        stripped = text.lstrip()
        if stripped.startswith("[") or stripped.startswith("{"):
            return cls(_parse_json(text, path))
        keys = [line.strip() for line in text.splitlines()]
        keys = [k for k in keys if k and not k.startswith("#")]
        return cls([(f"key-{i}", k, KeyLimits()) for i, k in enumerate(keys)])

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key named by an `Authorization: Bearer ...` header, or None."""
        found = match_digest(authorization, [key.digest for key in self.keys])
        return None if found is None else self.keys[found]


def _parse_json(text: str, path: str) -> list[tuple]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("keys"), list):
        data = data["keys"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of key objects")
    out = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not entry["key"]:
            raise ValueError(f"{path}: entry {i} needs a non-empty string 'key'")
        limits = {}
        for field in ("prompt_tokens_per_minute", "completion_tokens_per_minute", "total_tokens_per_minute"):
            value = entry.get(field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{path}: entry {i}: {field} must be a positive integer")
            limits[field] = value
        unknown = set(entry) - {"key", "name", "prefill_pool", "priority", "admin", *limits}
        if unknown:
            raise ValueError(f"{path}: entry {i}: unknown fields {sorted(unknown)}")
        pool = entry.get("prefill_pool")
        if pool is not None and (not isinstance(pool, str) or not pool):
            raise ValueError(f"{path}: entry {i}: prefill_pool must be a pool name given with --prefill NAME=URL")
        priority = entry.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**31) <= priority < 2**31:
            raise ValueError(f"{path}: entry {i}: priority must be an integer (lower runs first)")
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{path}: entry {i}: admin must be true or false")
        out.append((str(entry.get("name") or f"key-{i}"), entry["key"], KeyLimits(**limits), pool, priority, admin))
    return out
