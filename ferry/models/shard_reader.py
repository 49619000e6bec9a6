"""Read a safetensors checkpoint's tensors with several threads, handed out in checkpoint order.

Loading a sharded checkpoint is mostly reading: each tensor is copied out of its file's memory
map, which faults its pages in from disk or the page cache, then converted and copied into the
model. One thread does one page at a time, and the model's copies wait for it; here a few
threads read ahead (safetensors and torch release the GIL while they copy) while the loader copies
the tensors already read into its parameters. At most `max_bytes` of read-ahead are held at once
(at least one tensor), so the host holds no more than that beyond what the model keeps, whatever
the checkpoint's size. Each thread opens its own handle on each file (a handle is not shared
between threads).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

# safetensors' dtype names -> bytes per element (what the read-ahead bound counts)
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


def slice_bytes(f, name: str) -> int:
    """The size of tensor `name` of an open safetensors file `f`, from its header (nothing is read)."""
    s = f.get_slice(name)
    return math.prod(s.get_shape()) * _ITEMSIZE.get(s.get_dtype(), 4)


def tensor_bytes(file: str, names: list[str]) -> list[int]:
    """The size of each named tensor of `file`, from its header (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return [slice_bytes(f, name) for name in names]


def read_ahead(entries: list[tuple[str, str]], sizes: list[int], workers: int,
               max_bytes: int = 1 << 30) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """(name, tensor) for each (file, name) of `entries`, in order, read by `workers` threads
    ahead of the consumer, with at most `max_bytes` (`sizes` counts them) read and not yet taken."""
    from safetensors import safe_open

    local = threading.local()

    def read(file: str, name: str) -> torch.Tensor:
        handles = local.__dict__.setdefault("handles", {})
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        return handles[file].get_tensor(name)

    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="ferry-shard-reader")
    pending: deque = deque()
    held = 0  # bytes submitted and not yet handed out
    i = 0
    try:
        while i < len(entries) or pending:
            while i < len(entries) and (not pending or held + sizes[i] <= max_bytes):
                pending.append((entries[i][1], sizes[i], pool.submit(read, *entries[i])))
                held += sizes[i]
                i += 1
            name, size, future = pending.popleft()
            tensor = future.result()
            held -= size
            yield name, tensor
    finally:  # the consumer stopped (or failed): nothing more is read
        pool.shutdown(wait=True, cancel_futures=True)
