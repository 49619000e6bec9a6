"""One step's inputs laid out on the host (`StepPlan`), built from the scheduler's decision, and
the record of where the step's time went (`StepRecord`).

Decode rows come first, then prefill chunks, in one flat token list with positions and a slot
(block id x block size + offset) per token; all numpy, so rank 0 can broadcast the plan to the
other tensor-parallel ranks and the runner copies it to the device once.

A request verifying k draft tokens (speculative decoding) is k + 1 decode rows over its own
blocks: its last token, then the drafts, at consecutive positions, each row attending to the
cache up to its own position. Every layer writes all rows' K/V before it attends, so each row
sees the ones before it, and every decode kernel (the CPU C++ step, Triton, CUDA graphs) serves
verification as it serves decode.

A tree of drafts (`SchedulerOutput.spec_parents`, in preorder) is laid out the same way, each
draft stored at the next slot, but at the position of its depth, and with a mask (`decode_tree`)
that hides the drafts before it which are not its ancestors; the backends that take the mask
(the torch one, the C++ decode step) verify it. The accepted path's K/V are moved to consecutive
slots afterwards (`ModelRunner`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ferry.core.request import Request
from ferry.core.scheduler import SchedulerOutput
from ferry.layers.attention import PrefillHost
from ferry.utils.math import cdiv


@dataclass
class StepPlan:
    """One step's inputs on the host; what rank 0 broadcasts to the other tensor-parallel ranks."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    decode_blocks: list[np.ndarray]  # per decode row, its block ids
    decode_seq_lens: np.ndarray  # [num_decodes] int64
    prefills: list[PrefillHost]
    logits_rows: np.ndarray  # rows of the batch that need logits
    decode_tree: np.ndarray | None = None  # [num_decodes, 2] (AttentionMetadata.decode_tree); None: no tree
    # Embedding requests' rows: (request id, first row, number of rows, the position after the last
    # row); pooled, never sampled.
    pool_chunks: list[tuple[str, int, int, int]] = field(default_factory=list)
    # Prompt-logprob rows: (request id, first row, position of the first row, top-k, the prompt
    # tokens that follow the rows); row j's logits give the logprob of targets[j].
    prompt_logprob_chunks: list[tuple[str, int, int, int, list[int]]] = field(default_factory=list)
    # Per row, the LoRA adapter slot it runs under (-1: none); None when no row has one (layers/lora.py).
    lora_slots: np.ndarray | None = None

    @property
    def num_decodes(self) -> int:
        return len(self.decode_blocks)


@dataclass
class CollectStep:
    """Pipeline parallelism: stage 0's ranks take the oldest step they ran back from the last stage
    (its final hidden states) and compute its logits together."""


@dataclass
class StepRecord:
    """One step's shape and the seconds spent in each phase (the `--profile` breakdown)."""

    num_decodes: int
    num_prefill_tokens: int
    decode_context_tokens: int  # K/V positions read by the decode rows
    # Of the decode rows, those that ran only the layers after early exit's exit layer, from the
    # residual streams its draft left (model_runner.py: `_execute_from_streams`).
    num_stream_rows: int = 0
    # Seconds in each phase: scheduling, building the plan, the forward pass, sampling, applying tokens.
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0

    def total(self) -> float:
        """Seconds of the whole step."""
        return self.schedule + self.prepare + self.forward + self.sample + self.update


def build_step_plan(sched: SchedulerOutput, block_size: int) -> tuple[StepPlan, list[Request], list[list[int]]]:
    """The step's flat batch, the requests that sample at its end (in logits-row order), and
    each one's draft tokens to verify (one logits row per draft and one after them).

    A request whose one new token is not its first computed one is a decode row, and so is
    each token of a request verifying drafts; everything else (a prompt chunk, a recomputation
    after preemption) is a prefill chunk."""
    bs = block_size
    spec = sched.spec_token_ids
    decodes, prefills = [], []
    for request, n in sched.scheduled:
        is_decode = (n == 1 and request.num_computed_tokens > 1) or request.request_id in spec
        (decodes if is_decode else prefills).append((request, n))
    ids: list[int] = []
    pos_parts: list[np.ndarray] = []
    slot_parts: list[np.ndarray] = []
    logits_rows: list[int] = []
    sampling: list[Request] = []
    drafts: list[list[int]] = []
    pool_chunks: list[tuple[str, int, int, int]] = []
    prompt_lp_chunks: list[tuple[str, int, int, int, list[int]]] = []

    def prompt_rows(r: Request, row: int, n: int, begin: int) -> None:
        """Rows whose next token is a prompt token: logits for prompt_logprobs (not again for a
        request recomputed after preemption: it sent them with its first token)."""
        k = r.sampling_params.prompt_logprobs
        if k is not None and r.num_output_tokens == 0:
            targets = r.prompt_token_ids[begin + 1 : begin + 1 + n]
            if targets:
                prompt_lp_chunks.append((r.request_id, row, begin, k, targets))

    nd = sum(n for _, n in decodes)  # rows: a verifying request has one per token
    decode_blocks: list[np.ndarray] = []
    seq_lens = np.empty(nd, dtype=np.int64)
    tree = np.empty((nd, 2), dtype=np.int64) if sched.spec_parents else None
    if nd:
        dec_pos = np.empty(nd, dtype=np.int64)
        dec_slot = np.empty(nd, dtype=np.int64)
        i = 0
        for r, n in decodes:
            blocks = sched.block_ids[r.request_id]
            table = np.asarray(blocks, dtype=np.int64)
            draft = spec.get(r.request_id, [])
            parents = sched.spec_parents.get(r.request_id)
            first = r.num_computed_tokens - n  # position of the row's (first) token
            depths = tree_depths(parents) if parents is not None else None
            for j in range(n):
                p = first + j  # where its K/V is stored
                decode_blocks.append(table)
                seq_lens[i] = p + 1  # includes the token computed now
                dec_pos[i] = first + depths[j] if depths is not None else p
                dec_slot[i] = blocks[p // bs] * bs + p % bs
                ids.append(r.all_token_ids[p] if j == 0 else draft[j - 1])
                if tree is not None:
                    tree[i] = (first + 1, ancestor_bits(parents, j)) if depths is not None else (p + 1, 0)
                prompt_rows(r, i, 1, p)
                if r.sampling_params.pooling is not None:  # an embedding's 1-token chunk
                    pool_chunks.append((r.request_id, i, 1, p + 1))
                elif draft or p + 1 == r.num_tokens:
                    logits_rows.append(i)
                i += 1
            if r.sampling_params.pooling is None and (draft or first + 1 == r.num_tokens):
                sampling.append(r)
                drafts.append(draft)
        pos_parts.append(dec_pos)
        slot_parts.append(dec_slot)

    chunks: list[PrefillHost] = []
    start = nd
    for r, n in prefills:
        end_ctx = r.num_computed_tokens
        begin = end_ctx - n
        blocks = np.asarray(sched.block_ids[r.request_id], dtype=np.int64)
        pos = np.arange(begin, end_ctx, dtype=np.int64)
        ids.extend(r.all_token_ids[begin:end_ctx])
        pos_parts.append(pos)
        slot_parts.append(blocks[pos // bs] * bs + pos % bs)
        chunks.append(PrefillHost(start, n, end_ctx, blocks))
        prompt_rows(r, start, n, begin)
        if r.sampling_params.pooling is not None:  # an embedding: pooled, never sampled
            pool_chunks.append((r.request_id, start, n, end_ctx))
        elif end_ctx == r.num_tokens:  # the chunk reaches the end: sample the next token
            logits_rows.append(start + n - 1)
            sampling.append(r)
            drafts.append([])
        start += n

    lora_slots = None
    if any(r.lora_slot >= 0 for r, _ in sched.scheduled):
        lora_slots = np.concatenate([np.full(n, r.lora_slot, dtype=np.int64) for r, n in (*decodes, *prefills)])
    plan = StepPlan(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=np.concatenate(pos_parts),
        slot_mapping=np.concatenate(slot_parts),
        decode_blocks=decode_blocks,
        decode_seq_lens=seq_lens,
        prefills=chunks,
        logits_rows=np.asarray(logits_rows, dtype=np.int64),
        decode_tree=tree,
        pool_chunks=pool_chunks,
        prompt_logprob_chunks=prompt_lp_chunks,
        lora_slots=lora_slots,
    )
    return plan, sampling, drafts


def decode_rows_plan(rows: list[tuple[int, int, list[int]]], block_size: int, logits_rows: list[int]) -> StepPlan:
    """Decode rows given one by one: (token, position, its sequence's block ids) each, storing its
    K/V at its position and attending to the cache up to it; logits for `logits_rows`. Early
    exit's draft passes, which feed tokens the scheduler has not scheduled yet."""
    bs = block_size
    positions = np.asarray([p for _, p, _ in rows], dtype=np.int64)
    return StepPlan(
        input_ids=np.asarray([t for t, _, _ in rows], dtype=np.int64),
        positions=positions,
        slot_mapping=np.asarray([blocks[p // bs] * bs + p % bs for _, p, blocks in rows], dtype=np.int64),
        decode_blocks=[np.asarray(blocks, dtype=np.int64) for _, _, blocks in rows],
        decode_seq_lens=positions + 1,
        prefills=[],
        logits_rows=np.asarray(logits_rows, dtype=np.int64),
    )


def tree_paths(parents: list[int]) -> list[list[int]]:
    """For a tree of drafts in preorder (`Request.spec_parents`: draft i's parent is
    parents[i - 1], 0 the root), each node's path: the drafts from the root down to it ([] for
    the root)."""
    paths: list[list[int]] = [[]]
    for i, parent in enumerate(parents, 1):
        paths.append(paths[parent] + [i])
    return paths


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of the root (0) and of each draft of a tree in preorder (`Request.spec_parents`)."""
    return [len(path) for path in tree_paths(parents)]


def ancestor_bits(parents: list[int], node: int) -> int:
    """The drafts `node` attends to, as bits over the drafts (bit i - 1: draft i): its ancestors
    and itself (int64: the 64th draft's bit is the sign)."""
    bits = 0
    while node > 0:
        bits |= 1 << (node - 1)
        node = parents[node - 1]
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def profiling_plan(num_tokens: int, chunk: int, num_seqs: int, block_size: int, vocab_size: int) -> StepPlan:
    """A prefill of `num_tokens` prompt tokens in chunks of at most `chunk` (consecutive blocks
    from 0, `profiling_blocks` of them) with `min(num_seqs, num_tokens)` logits rows: the largest
    step the engine can schedule, for measuring peak memory."""
    bs = block_size
    starts = list(range(0, num_tokens, chunk))
    per_chunk = cdiv(chunk, bs)
    pos = np.concatenate([np.arange(min(chunk, num_tokens - s), dtype=np.int64) for s in starts])
    prefills, slots = [], []
    for i, s in enumerate(starts):
        n = min(chunk, num_tokens - s)
        table = np.arange(i * per_chunk, (i + 1) * per_chunk, dtype=np.int64)
        prefills.append(PrefillHost(s, n, n, table))
        slots.append(table[np.arange(n) // bs] * bs + np.arange(n) % bs)
    return StepPlan(
        input_ids=pos % vocab_size,
        positions=pos,
        slot_mapping=np.concatenate(slots),
        decode_blocks=[],
        decode_seq_lens=pos[:0],
        prefills=prefills,
        logits_rows=np.full(min(num_seqs, num_tokens), num_tokens - 1, dtype=np.int64),
    )


def profiling_blocks(num_tokens: int, chunk: int, block_size: int) -> int:
    """KV blocks `profiling_plan` writes into."""
    return cdiv(chunk, block_size) * len(range(0, num_tokens, chunk))
