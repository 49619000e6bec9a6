"""Zeroed CPU tensors whose pages cost nothing until written.

`torch.zeros` writes every page up front: a 2 GiB KV cache took 0.6 s of every server's start
on this VM, and all of it counted in the process's resident memory whether used or not. Fresh
anonymous memory from the kernel (mmap) is zero by definition and backed page by page on first
touch, so the cache costs only what requests fill, when they fill it (transparent huge pages
asked for, so that is a fault per 2 MiB rather than per 4 KiB). CUDA tensors stay torch.zeros
(the device zeroes them in microseconds).
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

LAZY_MIN_BYTES = 1 << 20  # smaller tensors: torch.zeros (a page or two is no saving)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype, device=device)`; on the CPU, from fresh anonymous memory."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP here: 4 KiB pages, still lazy
        buf.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the buffer: the mapping lives as long as the tensor's storage does.
    return torch.frombuffer(buf, dtype=dtype).view(shape)
