"""The prefill chunks' contexts laid out back to back for MLA's expanded prefill
(ferry/layers/attention/contexts.py): which cache slot each row of the layout reads, each chunk's
tables into it, and the grouping that bounds how many rows one call expands."""

from __future__ import annotations

import numpy as np
import torch

from ferry.layers.attention.contexts import context_groups
from ferry.layers.attention.metadata import AttentionMetadata, PrefillHost


def _meta(prefills: list[PrefillHost], block_size: int = 4, rows: int = 0) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.zeros(rows, dtype=torch.int64), block_size=block_size,
                             prefills=prefills)  # fmt: skip


def test_each_chunk_reads_its_whole_context_from_consecutive_blocks():
    # a whole 6-token prompt in blocks 7, 2; a chunk of 3 behind a 6-token prefix in blocks 5, 9, 1
    chunks = [PrefillHost(start=2, length=6, context_len=6, block_ids=np.array([7, 2])),
              PrefillHost(start=8, length=3, context_len=9, block_ids=np.array([5, 9, 1]))]  # fmt: skip
    (group,) = context_groups(_meta(chunks), torch.device("cpu"), max_rows=64)
    assert group.first == 0 and group.rows == (2, 11) and group.max_query_len == 6
    first = [28, 29, 30, 31, 8, 9] + [28, 28]  # past the context: the chunk's first slot again
    second = [20, 21, 22, 23, 36, 37, 38, 39, 4] + [20, 20, 20]
    assert group.slots.tolist() == first + second
    assert group.tables.tolist() == [[0, 1, 0], [2, 3, 4]]  # the second chunk's blocks follow the first's
    assert group.spans.tolist() == [[2, 6, 6], [8, 3, 9]]


def test_groups_hold_at_most_max_rows_unless_one_chunk_is_longer():
    lens = [4, 4, 12, 2, 2]  # padded to blocks of 4: 4, 4, 12, 4, 4 rows
    chunks, start = [], 0
    for n in lens:
        chunks.append(PrefillHost(start=start, length=n, context_len=n, block_ids=np.arange(3) + start))
        start += n
    groups = context_groups(_meta(chunks), torch.device("cpu"), max_rows=8)
    assert [(g.first, g.tables.shape[0]) for g in groups] == [(0, 2), (2, 1), (3, 2)]
    assert [g.rows for g in groups] == [(0, 8), (8, 20), (20, 24)]
    assert [g.slots.numel() for g in groups] == [8, 12, 8]
    assert context_groups(_meta([]), torch.device("cpu")) == []


def test_by_default_a_group_expands_no_more_than_the_step_or_its_longest_context():
    """What the memory profile saw (a step of the token budget's rows, expanded whole) or what one chunk
    alone needed before the chunks went together: the longer of the step's rows and its longest context."""
    chunks = [PrefillHost(start=0, length=3, context_len=8, block_ids=np.arange(2)),
              PrefillHost(start=3, length=3, context_len=8, block_ids=np.arange(2)),
              PrefillHost(start=6, length=4, context_len=20, block_ids=np.arange(5))]  # fmt: skip
    groups = context_groups(_meta(chunks, rows=10), torch.device("cpu"))  # bound: max(10, 20) rows
    assert [g.tables.shape[0] for g in groups] == [2, 1]
    groups = context_groups(_meta(chunks, rows=40), torch.device("cpu"))  # a 40-row step: all at once
    assert [g.tables.shape[0] for g in groups] == [3]
