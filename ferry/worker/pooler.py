"""Embeddings: a request's prompt pooled from the model's final hidden states, chunk by chunk.

An embedding request (`SamplingParams.pooling`) is a prompt the scheduler computes like any other,
with chunked prefill and next to generating requests, but its rows are pooled instead of sampled
(step_plan.py lists them in `pool_chunks`). Chunks arrive in order; a preempted request starts
over from its first token, which resets its sum.
"""

from __future__ import annotations

import torch

from ferry.core.request import Request
from ferry.worker.step_plan import StepPlan


def pool_step(plan: StepPlan, hidden: torch.Tensor, requests: dict[str, Request], default_type: str) -> list[Request]:
    """Fold this step's rows into each embedding request; returns those whose prompt is now
    complete, with `Request.embedding` set."""
    done = []
    for rid, start, n, end in plan.pool_chunks:
        r = requests.get(rid)
        if r is None:  # aborted or preempted while its step was in flight (pipeline parallelism)
            continue
        params = r.sampling_params.pooling
        kind = params.pooling_type or default_type
        rows = hidden[start : start + n]
        first = end - n == 0
        if kind == "mean":
            part = rows.float().sum(dim=0)
            r.pooled = part if first or r.pooled is None else r.pooled + part
        elif kind == "cls":
            if first:
                r.pooled = rows[0].float()
        elif end == r.num_tokens:  # last
            r.pooled = rows[-1].float()
        if end == r.num_tokens:
            vector = r.pooled / r.num_tokens if kind == "mean" else r.pooled
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            r.embedding = vector.cpu().tolist()
            r.pooled = None
            done.append(r)
    return done
