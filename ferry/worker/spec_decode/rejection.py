"""Rejection sampling of draft tokens (Leviathan et al., 2023; Chen et al., 2023), for drafts
proposed without a distribution of their own (n-gram lookup: all of a draft's mass is on the
token it proposes, q = one-hot(d)).

With the model's distribution p at a draft position, d is kept with probability
min(1, p(d) / q(d)) = p(d); on rejection the token is drawn from the residual
max(0, p - q) / (1 - p(d)), which is p with d removed. Kept or redrawn, the token is distributed
as p: P(t = d) = p(d), and for t != d, P(t) = (1 - p(d)) * p(t) / (1 - p(d)) = p(t).
"""

from __future__ import annotations

import torch


def accept_or_resample(
    probs: torch.Tensor, drafts: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `probs` [R, V]: whether its draft (`drafts` [R], -1 for a row without one) is
    kept (uniform [R] in [0, 1) below p(draft)), and the token drawn from the residual should it
    not be (the exponential race, argmax(residual / noise), with the row's Exp(1) `noise` [R, V]).
    Rows without a draft get False and an arbitrary token; the caller does not read them."""
    has = drafts >= 0
    idx = drafts.clamp(min=0).unsqueeze(1)
    p_draft = probs.gather(1, idx).squeeze(1)
    accepted = has & (uniform < p_draft)
    residual = probs.scatter(1, idx, 0.0)
    resampled = (residual / noise).argmax(dim=-1)
    return accepted, resampled
