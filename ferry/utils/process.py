"""Process lifetime."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies: a SIGKILLed parent runs no cleanup,
    and a child left behind would hold its GPU memory and ports. A no-op where prctl is missing
    (callers that must notice a dead parent elsewhere also poll os.getppid)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
