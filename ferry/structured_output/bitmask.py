"""The token bitmask of a batch: which tokens each constrained row's grammar allows next.

One bit per token, 32 to an int32 (llguidance's layout). Rows without drafts before them are
filled in parallel by llguidance's executor (it drops the GIL) on machines with cores to spare;
a row that follows drafts (speculative decoding) is filled after its matcher consumes them, then
rolled back, so the
request's state never moves for a draft the model does not keep. Rows after a draft the grammar
forbids are left all-allowed: that draft is masked out of the row before it, so is never kept,
and nothing sampled from the rows after it is used.
"""

from __future__ import annotations

import os

import llguidance
import llguidance.numpy as llg_numpy  # not llguidance.torch: importing it loads torch._dynamo (~3 s of start-up)
import numpy as np
import torch

from ferry.structured_output.compiler import GrammarState

_executor: llguidance.LLExecutor | None = None
# Below this many cores the masks are filled in the calling thread: a row takes 5-50 us, and the
# executor's threads, still spinning when the next forward starts, cost that forward more than
# they save (measured on 2 cores: forward 16.3 -> 18.7 ms a step at batch 16).
PARALLEL_FILL_MIN_CPUS = 8


def _parallel() -> llguidance.LLExecutor | None:
    global _executor
    cpus = os.cpu_count() or 1
    if cpus < PARALLEL_FILL_MIN_CPUS:
        return None
    if _executor is None:
        _executor = llguidance.LLExecutor(min(8, cpus // 2))
    return _executor


def fill_bitmask(rows: list[tuple[GrammarState, list[int]]], vocab_size: int) -> torch.Tensor:
    """[len(rows), ceil(vocab / 32)] int32 on the CPU: row i's mask for its grammar after the drafts
    `rows[i][1]`. A row whose grammar is still closed there (reasoning) allows everything."""
    bitmask = llg_numpy.allocate_token_bitmask(len(rows), vocab_size)  # all allowed
    plain = [(state.matcher, i) for i, (state, prior) in enumerate(rows) if not prior and state.open]
    executor = _parallel() if len(plain) > 1 else None
    if executor is not None:
        llg_numpy.fill_next_token_bitmask_par(executor, plain, bitmask)
    else:
        for matcher, i in plain:
            llg_numpy.fill_next_token_bitmask(matcher, bitmask, i)
    for i, (state, prior) in enumerate(rows):
        if prior:
            mark = state.mark()
            if state.try_consume(prior) and state.open:
                llg_numpy.fill_next_token_bitmask(state.matcher, bitmask, i)
            state.restore(mark)
    return torch.from_numpy(bitmask)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with every token row `rows[j]`'s mask `bitmask[j]` forbids set to -inf (a copy)."""
    B, V = logits.shape
    if logits.device.type == "cpu":
        # numpy unpacks a 16 x 49k batch in ~0.1 ms; torch's shifts over [B, V / 32, 32] took 3-9 ms.
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
    else:  # unpacked on the device: the packed mask is 32x fewer bytes to copy
        packed = bitmask.to(logits.device, non_blocking=True)
        shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
        allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < V:  # tokens past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]))
    allowed = allowed[:, :V]
    if len(rows) != B or rows != list(range(B)):  # some rows unconstrained: they allow everything
        full = torch.ones(B, V, dtype=torch.bool, device=logits.device)
        full[torch.tensor(rows, device=logits.device)] = allowed
        allowed = full
    return torch.where(allowed, logits, float("-inf"))
