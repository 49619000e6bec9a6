"""The API process's connection to the EngineCore process: spawning it, the two ZMQ sockets, and
whether it is still alive.

Inputs go through a plain (synchronous) PUSH socket with no high-water mark: a send either
happens now or raises (the core is not connected), which keeps aborts from cancellation
handlers simple. Outputs come through an asyncio PULL socket. Both are ipc sockets in a private
temporary directory, named for the process that made it; the client removes it at shutdown, and
a process killed before that (SIGKILL, the OOM killer) leaves it behind for the next client on
the machine to remove (`remove_stale_ipc_dirs`). This module imports no model code: the core
process imports `core_proc.py` itself once spawned.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from ferry.config import EngineArgs, KVEventsConfig, KVTransferConfig
from ferry.engine.messages import CoreFailed, CoreReady, EngineInfo, OutputMessage, UtilityCall
from ferry.utils.process import process_age

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone; nothing more can be served."""


def _run_core_process(*args) -> None:
    """The spawned process's target. The import happens there: the API process never loads the
    engine core's modules (the model, the runner, the kernels)."""
    from ferry.engine.core_proc import run_engine_core

    run_engine_core(*args)


@dataclass
class SpawnedCore:
    """A core process started before its client existed (`spawn_engine_core`)."""

    proc: multiprocessing.Process
    ipc_dir: str  # where the client binds the sockets the core connects to
    spawned_at: float | None  # this process's age then (the API process's start phase), Linux only


_IPC_PREFIX = "ferry-ipc-"
_STALE_IPC_DIR = re.compile(rf"{_IPC_PREFIX}(\d+)-[A-Za-z0-9_]+")


def new_ipc_dir() -> str:
    """A private (0700) directory for one client's sockets, named for this process."""
    remove_stale_ipc_dirs()
    return tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{os.getpid()}-")


def remove_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove the socket directories (this user's) of processes that are gone; the paths removed.
    A directory whose process lives, or whose number a new process took, is left: a removal needs
    the process to be dead, never a guess about age."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = _STALE_IPC_DIR.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue  # a link, or another user's: not ours to remove
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except (OSError, OverflowError):  # alive under another user (EPERM), or gone meanwhile
            continue
    return removed


def _addresses(ipc_dir: str) -> tuple[str, str]:
    return f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output"


def spawn_engine_core(args: EngineArgs, kv_events: KVEventsConfig | None = None,
                      kv_transfer: KVTransferConfig | None = None,
                      ipc_dir: str | None = None) -> SpawnedCore:  # fmt: skip
    """Start the core process (it loads the model and warms up). It connects to the client's
    sockets, which need not be bound yet (ZMQ retries): `ferry serve` spawns it before importing
    its HTTP side, so the two processes start side by side (serve_command.py)."""
    ipc_dir = ipc_dir or new_ipc_dir()
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
    level = logging.getLogger("ferry").getEffectiveLevel()
    proc = ctx.Process(
        target=_run_core_process,
        args=(args, *_addresses(ipc_dir), level, kv_events, kv_transfer, time.time()),
        name="ferry-engine-core",
        # A daemonic process may not start children: tensor-parallel ranks are the core's
        # children (they and the core die with their parent through PR_SET_PDEATHSIG).
        daemon=args.world_size == 1,
    )
    proc.start()
    logger.info("EngineCore process %d started", proc.pid)
    return SpawnedCore(proc, ipc_dir, process_age())


class EngineCoreClient:
    def __init__(
        self,
        args: EngineArgs,
        kv_events: KVEventsConfig | None = None,
        kv_transfer: KVTransferConfig | None = None,
        spawned: SpawnedCore | None = None,
    ) -> None:
        self.args = args
        self.kv_events = kv_events
        self.kv_transfer = kv_transfer
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(OutputMessage)
        self._ipc_dir = spawned.ipc_dir if spawned is not None else new_ipc_dir()
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        input_addr, output_addr = _addresses(self._ipc_dir)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(output_addr)
        self.proc: multiprocessing.Process | None = spawned.proc if spawned is not None else None
        self.spawned_at: float | None = spawned.spawned_at if spawned is not None else None

    def spawn(self) -> None:
        """Start the core process (it loads the model and warms up; see `wait_ready`), unless it
        was spawned already and handed to this client."""
        if self.proc is None:
            spawned = spawn_engine_core(self.args, self.kv_events, self.kv_transfer, self._ipc_dir)
            self.proc, self.spawned_at = spawned.proc, spawned.spawned_at

    async def wait_ready(self, timeout: float) -> EngineInfo:
        """The core's EngineInfo once it has loaded and warmed the model; EngineDeadError if it
        failed, exited or took longer than `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            msg = await self.recv(200)
            if isinstance(msg, CoreReady):
                return msg.info
            if isinstance(msg, CoreFailed):
                raise EngineDeadError(f"EngineCore failed to start: {msg.message}")
            if msg is None and not self.alive:
                raise EngineDeadError(f"EngineCore exited with code {self.exitcode} while starting")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"EngineCore did not become ready within {timeout:.0f}s")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode if self.proc is not None else None

    def encode(self, msg) -> bytes:
        return self._encoder.encode(msg)

    def send(self, msg) -> None:
        self.send_bytes(self._encoder.encode(msg))

    def send_bytes(self, data: bytes) -> None:
        # With no high-water mark a PUSH send only fails when the core is not connected.
        try:
            self._input.send(data, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError("EngineCore is not connected") from None

    async def recv(self, timeout_ms: int) -> OutputMessage | None:
        """The core's next message, or None if none came within `timeout_ms`."""
        if not await self._output.poll(timeout_ms):
            return None
        return self._decoder.decode(await self._output.recv())

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the core to stop, then terminate and kill it if it does not; close the sockets."""
        if self.alive:
            try:
                self.send(UtilityCall(-1, "shutdown"))
            except EngineDeadError:
                pass
            await asyncio.to_thread(self.proc.join, timeout)
            if self.proc.is_alive():
                self.proc.terminate()
                await asyncio.to_thread(self.proc.join, 2.0)
            if self.proc.is_alive():
                self.proc.kill()
        self._input.close()
        self._output.close()
        self._ctx.term()
        self._sync_ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
