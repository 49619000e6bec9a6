"""utils/lazy_zeros.py: zeroed CPU tensors (the KV cache's) whose pages cost nothing until written."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from ferry.utils.lazy_zeros import zeros


def resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_lazy_zeros_are_zeros_of_the_asked_shape_and_dtype(dtype):
    t = zeros((64, 16, 3, 128), dtype, "cpu")  # 1.5 MiB or more: the lazy path
    assert t.shape == (64, 16, 3, 128) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % 64 == 0  # page-aligned: the C++ kernels' vector loads
    assert not t.float().any()
    small = zeros((4, 4), dtype, "cpu")  # below the threshold: torch.zeros
    assert small.shape == (4, 4) and small.dtype == dtype and not small.float().any()


def test_lazy_zeros_cost_no_memory_until_written_and_live_as_long_as_a_view():
    before = resident_bytes()
    t = zeros((512, 1024, 256), torch.float32, "cpu")  # 512 MiB
    assert resident_bytes() - before < 64 << 20  # not written: not resident
    t[7].fill_(1.0)  # 1 MiB written
    assert t.sum().item() == 1024 * 256
    view = t[7, :4]
    del t
    gc.collect()
    view.add_(1.0)  # the mapping outlives the name of the tensor it came from
    assert view.sum().item() == 2 * 4 * 256
