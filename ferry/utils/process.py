"""Process lifetime."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import signal
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies: a SIGKILLed parent runs no cleanup,
    and a child left behind would hold its GPU memory and ports. A no-op where prctl is missing
    (callers that must notice a dead parent elsewhere also poll os.getppid)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (reference counting still frees): loading SmolLM2's GGUF
    makes ~100k small metadata arrays, and the full collections their count set off took ~1.5 s
    of a 4.4 s load (10 of them, up to 290 ms each, late ones walking everything made so far)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_startup_heap() -> None:
    """Move every object alive now (the model's modules, the tokenizer's tables, imported modules)
    out of the cyclic garbage collector's reach, as vLLM does after start-up: a full collection
    walks the whole heap (~230 ms with SmolLM2 loaded), stalling every running request's next
    token; frozen, the heap is skipped and later objects are collected as usual. Thawing and
    collecting first lets a process that builds engines again (tests, benchmarks) reclaim the
    cycles of the ones it dropped instead of freezing them too."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc; None elsewhere): start-up phases are measured
    from the moment the interpreter was launched, imports included."""
    import os

    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError):
        return None
