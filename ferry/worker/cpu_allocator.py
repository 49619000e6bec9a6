"""Keep large CPU activations out of mmap/munmap.

glibc serves allocations above its mmap threshold with fresh mmaps and
returns them on free, so every prefill chunk's activations (tens of MB)
page-fault again on first touch. Raising the threshold to glibc's maximum
(32 MiB on 64-bit) and the trim threshold keeps them in the heap for reuse:
+15% prefill throughput measured on the 2-core CPU (BENCHMARKS.md).
Process-wide, idempotent, and a no-op where glibc's `mallopt` is absent.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def tune_cpu_allocator() -> bool:
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.debug("mallopt unavailable; CPU activations use the default allocator settings")
    _done = ok
    return ok


def release_free_heap() -> None:
    """Give the heap's free pages back to the OS (glibc `malloc_trim`), after loading a model: the
    checkpoint reader's objects and the float originals of packed or quantized weights are garbage
    by then, and the trim threshold set above would otherwise keep their pages resident for good
    (~60 MB for the bundled GGUF, measured: BENCHMARKS.md, issue 15 fourth part).

    Called inside the load's cyclic_gc_paused: no collection has run since the load began, so all it
    made is in the youngest generation, and collecting that one frees the same pages as a full
    collection (334 MiB resident after either) for 3 ms instead of 80 ms, or ~0.2 s in a test
    process whose heap holds other models. Called with the collector running, it collects it all."""
    gc.collect(2 if gc.isenabled() else 0)
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
