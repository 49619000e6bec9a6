"""Routing policies: pick one worker of a model's pool for a request.

- `round-robin` and `least-load` (fewest requests in flight or queued) know
  nothing of caches; they are the baselines.
- `kv-aware` scores each worker by the share of the prompt's blocks its prefix
  cache holds (from KV events, kv_index.py) against its load:
      score = prefix_weight * overlap - load_weight * load / (max load + 1)
              - kv_usage_weight * kv_usage
  where overlap = cached leading blocks / prompt blocks (0..1), load = the
  gateway's in-flight requests or the worker's running + waiting, whichever is
  larger, and kv_usage is the worker's KV-cache use (0..1). Ties go to the
  less loaded worker, then round-robin.
- `prefix`: the same score with the overlap from the gateway's own memory of
  what it routed where (prefix_index.py) instead of events.

Balance guard (kv-aware and prefix): when the busiest worker's load exceeds
the least busy's by more than `balance_abs` requests and by more than a factor
`balance_rel`, the request goes to the least loaded worker, whatever it
caches, so one hot prefix cannot pile every request onto one replica.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ferry.gateway.replicas import Worker

POLICIES = ("kv-aware", "prefix", "least-load", "round-robin")


@dataclass
class PolicyConfig:
    prefix_weight: float = 2.0
    load_weight: float = 1.0
    kv_usage_weight: float = 0.5
    balance_abs: float = 4.0  # requests
    balance_rel: float = 2.0  # busiest / least busy (+1 each)


@dataclass
class Decision:
    worker: Worker
    reason: str  # "round-robin" | "least-load" | "prefix-overlap" | "no-overlap" | "balance-guard"
    overlap: float  # 0..1: the chosen worker's cached share of the prompt (-1 when not computed)


class Router:
    def __init__(self, policy: str, config: PolicyConfig | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.config = config or PolicyConfig()
        self._rr = itertools.count()

    @property
    def needs_block_hashes(self) -> bool:
        return self.policy in ("kv-aware", "prefix")

    def choose(self, workers: list[Worker], num_prompt_blocks: int = 0, overlaps: list[int] | None = None) -> Decision:
        """`workers`: the healthy pool (non-empty), in a stable order; `overlaps[i]`: cached
        leading blocks of the prompt on workers[i] (kv-aware / prefix only)."""
        if not workers:
            raise ValueError("no worker to choose from")
        turn = next(self._rr)
        if self.policy == "round-robin":
            return Decision(workers[turn % len(workers)], "round-robin", -1.0)
        loads = [w.load for w in workers]
        least = min(range(len(workers)), key=lambda i: (loads[i], (i - turn) % len(workers)))
        if self.policy == "least-load":
            return Decision(workers[least], "least-load", -1.0)
        c = self.config
        share = [(o / num_prompt_blocks) if num_prompt_blocks else 0.0 for o in (overlaps or [0] * len(workers))]
        hi, lo = max(loads), min(loads)
        if hi - lo > c.balance_abs and (hi + 1) > c.balance_rel * (lo + 1):
            return Decision(workers[least], "balance-guard", share[least])
        scale = hi + 1.0
        scores = [
            c.prefix_weight * share[i] - c.load_weight * loads[i] / scale - c.kv_usage_weight * workers[i].kv_usage
            for i in range(len(workers))
        ]
        best = max(range(len(workers)), key=lambda i: (scores[i], -loads[i], -((i - turn) % len(workers))))
        return Decision(workers[best], "prefix-overlap" if share[best] > 0 else "no-overlap", share[best])
