"""vLLM's `prompt_logprobs`: each prompt token's logprob under the model given the tokens before
it (and its rank, and the most likely alternatives), from the rows of the prompt's chunks.

Computed in the forward (every tensor-parallel rank runs the LM head, a collective there) in
slices of SLICE_ROWS rows, so a 2,048-token chunk never holds its whole [rows, vocab] logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferry.worker.sampler import Logprob as Entry
from ferry.worker.sampler import ranked_logprobs
from ferry.worker.step_plan import StepPlan

SLICE_ROWS = 256


Logits = Callable[[torch.Tensor], torch.Tensor]


def prompt_logprobs(plan: StepPlan, hidden: torch.Tensor, compute_logits: Logits) -> list[tuple[str, int, list[Entry]]]:
    """Per chunk of `plan.prompt_logprob_chunks`: (request id, position of its first row, entries)."""
    out = []
    for rid, row, begin, k, targets in plan.prompt_logprob_chunks:
        entries: list[Entry] = []
        for s in range(0, len(targets), SLICE_ROWS):
            tgt = targets[s : s + SLICE_ROWS]
            logprobs = compute_logits(hidden[row + s : row + s + len(tgt)]).float().log_softmax(dim=-1)
            entries += ranked_logprobs(logprobs, tgt, k)
        out.append((rid, begin, entries))
    return out
