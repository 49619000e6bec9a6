"""Zeroed CPU tensors whose pages cost nothing until written.

`torch.zeros` writes every page up front: a 2 GiB KV cache took 0.6 s of every server's start
on this VM, and all of it counted in the process's resident memory whether used or not. Fresh
anonymous memory from the kernel (mmap) is zero by definition and backed page by page on first
touch, so the cache costs only what requests fill, when they fill it (transparent huge pages
asked for, so that is a fault per 2 MiB rather than per 4 KiB). CUDA tensors stay torch.zeros
(the device zeroes them in microseconds).

A page's first write is not free, though: on the 2-vCPU KVM guest ferry is developed on, faulting in
a fresh 2 MiB page took ~4.5 ms (the hypervisor backs it then; filling a fresh 256 MB took 291 ms, the
same bytes again 10 ms), and a step that wrote into a fresh block paid it (BENCHMARKS.md, session
26: a batch-16 decode crossed 28 such pages). `Populator` faults the pages in ahead of use from a
thread at idle priority, in the order the block pool hands blocks out, so an idle server pays them
instead of its requests, and the start stays as fast.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
import threading

import torch

logger = logging.getLogger(__name__)

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


MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, contents unchanged
_POPULATE_CHUNK = 2 << 20  # a transparent huge page at a time


def _madvise():
    """libc's madvise(addr, length, advice), or None where there is none (not Linux, no glibc)."""
    try:
        fn = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


class Populator:
    """Faults in the pages of lazily backed CPU tensors (`zeros`) from a background thread at idle
    priority (SCHED_IDLE: it runs only on a core nothing else wants, so a busy engine does not wait
    for it), in offset order across the tensors: the first 2 MiB of each, then the next, which is
    the order a fresh block pool hands blocks out (lowest id first) for the KV cache's per-layer
    tensors. Each call is one MADV_POPULATE_WRITE (ctypes drops the GIL around it); contents are
    never changed, so the engine may write the same pages meanwhile. `stop` ends it early (the
    cache is being freed); it holds the tensors until it ends."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]  # held while it runs
        page = mmap.PAGESIZE
        self._spans = []  # each tensor's whole pages: madvise takes page-aligned ranges (`zeros`' are whole)
        for t in self._tensors:
            first = -(-t.data_ptr() // page) * page
            end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
            if end > first:
                self._spans.append((first, end - first))
        self.total_bytes = sum(n for _, n in self._spans)
        self.populated_bytes = 0
        self.idle_priority = False
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferry-kv-populate", daemon=True)

    def start(self) -> Populator:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End it (before its next 2 MiB) and wait for it."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every page has been faulted in (or the thread has given up) within `timeout`."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._populate()
        finally:
            self._tensors = []

    def _populate(self) -> None:
        madvise = _madvise()
        if madvise is None:
            self.error = "no madvise"
            return
        with contextlib.suppress(AttributeError, OSError):  # (not Linux: normal priority, still off the path)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
            self.idle_priority = True
        longest = max((n for _, n in self._spans), default=0)
        for offset in range(0, longest, _POPULATE_CHUNK):
            for ptr, nbytes in self._spans:
                if self._stop.is_set():
                    return
                if offset >= nbytes:
                    continue
                length = min(_POPULATE_CHUNK, nbytes - offset)
                if madvise(ptr + offset, length, MADV_POPULATE_WRITE) != 0:
                    self.error = os.strerror(ctypes.get_errno())  # EINVAL: a kernel before 5.14
                    logger.debug("KV cache pages not populated ahead: madvise: %s", self.error)
                    return
                self.populated_bytes += length


def populate_in_background(tensors: list[torch.Tensor]) -> Populator:
    """Start a `Populator` over `tensors` (see there)."""
    return Populator(tensors).start()
