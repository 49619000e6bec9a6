"""Which worker of a set of candidates gets a request: the Router's choice, fed and recorded.

policies.py scores workers from numbers; this computes the numbers for one
request and remembers the outcome. When the policy needs them (kv-aware,
prefix), the prompt's chained block hashes (prompts.py, the block size the
workers report), and each candidate's cached overlap: from its KV-event
mirror (kv_index.py) for kv-aware, from the gateway's own memory of what it
sent where (prefix_index.py) for prefix. After the choice, the prompt's
blocks count as cached on the chosen worker (pending in its mirror, or in
the prefix index), so the next request sharing the prefix follows it.

Disaggregated serving chooses twice (disagg.py): the decode worker by load
and KV-cache use (ties rotate), the prefill worker by the Router over the
prefill pool, with each one's overlap from its KV-event mirror.
"""

from __future__ import annotations

import itertools

from ferry.gateway.admission import RequestContext
from ferry.gateway.disagg import choose_decode
from ferry.gateway.kv_index import KVMirrors
from ferry.gateway.metrics import GatewayMetrics
from ferry.gateway.policies import Decision, Router
from ferry.gateway.prefix_index import PrefixIndex
from ferry.gateway.prompts import PromptTokenizer
from ferry.gateway.replicas import Worker


class Routing:
    def __init__(self, router: Router, prefix_index: PrefixIndex, kv: KVMirrors, prompts: PromptTokenizer,
                 metrics: GatewayMetrics) -> None:  # fmt: skip
        self.router, self.prefix_index, self.kv, self.prompts, self.metrics = router, prefix_index, kv, prompts, metrics
        self._pd_turn = itertools.count()

    async def decide(self, ctx: RequestContext, pool: list[Worker]) -> Decision:
        """The worker of `pool` (non-empty) that serves this request, by the gateway's policy."""
        hashes: list[bytes] = []
        overlaps = None
        if self.router.needs_block_hashes:
            described = next((w for w in pool if w.info and w.info.get("block_size")), None)
            block_size = described.info["block_size"] if described is not None else None
            ids = await ctx.token_ids(self.prompts, pool[0]) if block_size else None
            if ids:
                hashes = self.kv.block_hashes(ids, block_size, ctx.cache_salt, ctx.model, described)
                if self.router.policy == "kv-aware":
                    overlaps = [self.kv.overlap(w, hashes) for w in pool]
                else:
                    overlaps = [self.prefix_index.overlap(hashes, w.url) for w in pool]
        decision = self.router.choose(pool, len(hashes), overlaps)
        if self.router.policy == "prefix" and hashes:
            self.prefix_index.insert(hashes, decision.worker.url)
        else:
            self.kv.add_pending(decision.worker, hashes)
        self.metrics.decisions.labels(ctx.model, decision.worker.url, decision.reason).inc()
        self.metrics.activity.routed(ctx.model, decision.worker.url, decision.reason, decision.overlap)
        if decision.overlap >= 0:
            self.metrics.overlap.observe(decision.overlap)
        return decision

    def choose_decode(self, candidates: list[Worker]) -> Worker:
        """Disaggregated: the decode worker, by load and KV-cache use; ties rotate."""
        return choose_decode(candidates, next(self._pd_turn), self.router.config.kv_usage_weight)

    def choose_prefill(self, candidates: list[Worker], hashes: list[bytes]) -> Worker:
        """Disaggregated: the prefill worker, by the Router over the prompt's overlap with each."""
        overlaps = [self.kv.overlap(w, hashes) for w in candidates]
        return self.router.choose(candidates, len(hashes), overlaps).worker
