"""Synthetic benchmark workloads: random token ids with uniform or ShareGPT-like lengths. Apart from
the engine benches (throughput.py) so that the HTTP-client benches (serve.py and the ones built on
it) import no torch: a bench's client process, or each abuser process it spawns, started ~1.5 s
slower with it."""

from __future__ import annotations

import math
import random


def synthetic_requests(n: int, in_range, out_range, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*in_range)
        reqs.append(([rng.randrange(100, vocab - 100) for _ in range(plen)], rng.randint(*out_range)))
    return reqs


# ShareGPT-like lengths: lognormal prompt / output token counts with these means (before clipping).
SHAREGPT_LIKE_MEANS = (200, 180)
SHAREGPT_LIKE_SIGMA = (1.0, 1.0)
SHAREGPT_LIKE_CLIP = (4, 2048)


def sharegpt_like_requests(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """`n` requests with lognormal prompt/output lengths (ShareGPT's rough shape), random token ids."""
    rng = random.Random(seed)
    lo, hi = SHAREGPT_LIKE_CLIP

    def length(mean: float, sigma: float) -> int:
        mu = math.log(mean) - sigma**2 / 2  # the lognormal's mean is exp(mu + sigma^2 / 2)
        return min(max(round(rng.lognormvariate(mu, sigma)), lo), hi)

    reqs = []
    for _ in range(n):
        plen = length(SHAREGPT_LIKE_MEANS[0], SHAREGPT_LIKE_SIGMA[0])
        olen = length(SHAREGPT_LIKE_MEANS[1], SHAREGPT_LIKE_SIGMA[1])
        reqs.append(([rng.randrange(100, vocab - 100) for _ in range(plen)], olen))
    return reqs
