"""The EngineCore's side of prefill/decode transfer, run on the core thread between steps.

- Prefill side: a request that asked for remote decode (`kv_export`) is exported when it
  finishes (its blocks are still cached then) and handed to the connector's sender.
- Decode side, with Redis: a new request whose prompt blocks are not all cached here is parked
  while the missing ones are pulled, then released to the scheduler (with the blocks imported,
  or without them once the pull fails or outlasts the timeout).
- Pushed blocks (tcp, shm) are imported as they arrive, and the receiver answers the sender.
Every outcome goes to the API process as a `KVTransferDone` through `report`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

import torch
import zmq

from ferry.config import KVTransferConfig
from ferry.core.block_hash import hash_prompt_blocks
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.kv_quant import BLOCK_LAYOUT, is_quantized
from ferry.kv_transfer.blocks import KVBlocks, export_blocks, import_blocks
from ferry.kv_transfer.connector import KVConnector, TransferResult
from ferry.kv_transfer.outcome import KVTransferDone
from ferry.kv_transfer.protocol import Done
from ferry.kv_transfer.receiver import ImportJob

logger = logging.getLogger("ferry.kv_transfer")


class TransferRequest(Protocol):
    """What the coordinator reads of a core request (ferry.engine.messages.EngineCoreRequest)."""

    request_id: str
    prompt_token_ids: list[int]
    prefilled_token_ids: list[int]
    kv_export: bool
    kv_target: str | None
    lora_name: str | None


class FinishedOutput(Protocol):
    request_id: str
    finish_reason: str | None


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE = 1 << 20  # bytes read at each end of a weight file


def model_identity(path: str) -> str:
    """What tells models apart in KV-transfer offers and a shared KV store, wherever each worker
    has its copy: a hash of the config and, for each weight file, its name, size and first and
    last MiB (the header and two tensors' values: two fine-tunes of one shape differ there almost
    surely). Not the path (mount points differ across hosts; a trailing slash once changed it),
    nor files beside the weights (a README)."""
    if not path:
        raise ValueError("model_identity needs the model's path (resolve_model_path)")
    h = hashlib.sha256()
    try:
        if os.path.isdir(path):
            config = os.path.join(path, "config.json")
            if os.path.isfile(config):
                with open(config, "rb") as f:
                    h.update(f.read())
            files = sorted(e.path for e in os.scandir(path) if e.is_file() and e.name.endswith(WEIGHT_SUFFIXES))
        else:
            files = [path]
        for name in files:
            size = os.path.getsize(name)
            h.update(f"{os.path.basename(name) if os.path.isdir(path) else ''}:{size}:".encode())
            with open(name, "rb") as f:
                h.update(f.read(_SAMPLE))
                f.seek(max(size - _SAMPLE, 0))
                h.update(f.read(_SAMPLE))
    except OSError as e:  # unreadable: no identity to share, so no peer's blocks are taken
        logger.warning("KV transfer: cannot read %s to name the model (%s)", path, e)
        return f"unreadable:{os.getpid()}"
    return h.hexdigest()[:24]


class KVTransferCoordinator:
    def __init__(
        self,
        config: KVTransferConfig,
        ctx: zmq.Context,
        kv: KVCacheManager,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        model_path: str,
        report: Callable[[KVTransferDone], None],
        lora_key: Callable[[str], str | None] | None = None,
    ) -> None:
        """`lora_key`: a LoRA adapter's name -> what its requests' block hashes mix in (the runner's)."""
        self.kv = kv
        self.lora_key = lora_key or (lambda name: None)
        self.kv_caches = kv_caches
        self.report = report
        k0 = kv_caches[0][0]
        _, bs, kvh, d = k0.shape
        layers = len(kv_caches)
        namespace = f"{model_identity(model_path)}:{layers}x{kvh}x{d}x{bs}"
        if is_quantized(k0.dtype):  # int8 and fp8 blocks are stored as they are: never mixed in one namespace,
            # nor with an older ferry's (rows, not BLOCK_LAYOUT)
            namespace += f":{str(k0.dtype).removeprefix('torch.')}:{BLOCK_LAYOUT}"
        max_payload = kv.pool.num_blocks * layers * 2 * bs * kvh * d * 4
        cached = kv.pool.cached
        self.connector = KVConnector(config, ctx, namespace, max_payload, has_block=lambda h: h in cached)
        self.exports: dict[str, TransferRequest] = {}  # prefill side: requests to send once finished
        self.parked: dict[str, TransferRequest] = {}  # decode side: requests waiting for a Redis pull
        self.parked_at: dict[str, float] = {}
        logger.info("KV transfer: role %s, sends by %s, receives on %s%s", config.role, config.transport or "-",
                    self.receiver_addr or "-", ", pulls from Redis" if self.pulls else "")  # fmt: skip

    def _lora_key(self, r: TransferRequest) -> str | None:
        """The block-hash key of the request's adapter, as the core hashes it (an unknown name keeps
        its own: the core refuses the request, and it matches no adapter's blocks)."""
        return (self.lora_key(r.lora_name) or r.lora_name) if r.lora_name else None

    @property
    def receiver_addr(self) -> str | None:
        return self.connector.receiver_addr

    @property
    def pulls(self) -> bool:
        return self.connector.redis is not None

    @property
    def wake(self) -> zmq.Socket:
        """Readable when a transfer thread has posted something: poll it beside the input socket."""
        return self.connector.wake

    def admit(self, r: TransferRequest) -> bool:
        """A new request: True if it may be scheduled now, False if it is parked behind a pull."""
        if r.kv_export:
            self.exports[r.request_id] = r
        if not self.pulls or not self.kv.enable_prefix_caching:
            return True
        # Blocks another worker computed may be in Redis: fetch the ones missing here first.
        bs = self.kv.block_size
        usable = (len(r.prompt_token_ids) + len(r.prefilled_token_ids) - 1) // bs
        hashes = hash_prompt_blocks(r.prompt_token_ids, bs, r.cache_salt, self.kv.block_hash_salt, self._lora_key(r))[
            :usable
        ]
        missing = self.connector.missing_prefix(hashes)
        if not missing:
            return True
        start = len(hashes) - len(missing)
        self.parked[r.request_id] = r
        self.parked_at[r.request_id] = time.monotonic()
        self.connector.pull(r.request_id, missing, hashes[start - 1] if start else None)
        return False

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.parked.pop(rid, None)
            self.parked_at.pop(rid, None)
            self.exports.pop(rid, None)

    def export_finished(self, outputs: list[FinishedOutput]) -> None:
        """Prefill side: send the blocks of requests that asked for it, now cached after their prefill."""
        if not self.exports:
            return
        for out in outputs:
            if out.finish_reason is None or out.request_id not in self.exports:
                continue
            r = self.exports.pop(out.request_id)
            if out.finish_reason == "abort":
                continue
            hashes = hash_prompt_blocks(r.prompt_token_ids, self.kv.block_size, r.cache_salt, self.kv.block_hash_salt,
                                        self._lora_key(r))  # fmt: skip
            payload = export_blocks(self.kv, self.kv_caches, hashes, encoding=self.connector.config.encoding)
            self.connector.send(r.request_id, payload, r.kv_target)

    def _import(self, payload: KVBlocks) -> int:
        return import_blocks(self.kv, self.kv_caches, payload)

    def poll(self) -> list[TransferRequest]:
        """Handle what the transfer threads posted; returns the parked requests that may run now."""
        runnable: list[TransferRequest] = []
        for ev in self.connector.drain():
            if isinstance(ev, ImportJob):
                self._on_pushed(ev)
            elif isinstance(ev, TransferResult):
                self._on_result(ev)
                r = self.parked.pop(ev.outcome.request_id, None)
                self.parked_at.pop(ev.outcome.request_id, None)
                if r is not None:
                    runnable.append(r)
        if self.parked_at:  # a pull stuck past the timeout: run the request without it
            limit = time.monotonic() - self.connector.config.timeout
            for rid in [rid for rid, t in self.parked_at.items() if t < limit]:
                del self.parked_at[rid]
                runnable.append(self.parked.pop(rid))
        return runnable

    def _on_pushed(self, job: ImportJob) -> None:
        n, error = 0, job.error
        if job.payload is not None:
            try:
                n = self._import(job.payload)
            except Exception as e:  # a peer's bad payload must not take the core down
                error = f"{type(e).__name__}: {e}"
        self.connector.receiver.reply(job.identity, Done(job.transfer_id, error is None, n, error))
        nbytes = job.payload.num_bytes if job.payload is not None else 0
        self.report(KVTransferDone(job.transfer_id, "received", error is None, n, nbytes,
                                   time.monotonic() - job.received_at, error))  # fmt: skip

    def _on_result(self, result: TransferResult) -> None:
        done = result.outcome
        if result.payloads:  # a Redis pull: import, then the parked request may run
            try:
                n = self._import(KVBlocks.join(result.payloads))
                done = KVTransferDone(done.request_id, done.direction, done.ok, n, done.num_bytes, done.seconds)
            except Exception as e:  # a bad stored value must not take the core down
                done = KVTransferDone(done.request_id, done.direction, False, 0, done.num_bytes, done.seconds,
                                      f"{type(e).__name__}: {e}")  # fmt: skip
        # A pull that found nothing is no transfer: nothing to report.
        if result.payloads is None or done.error is not None or done.num_blocks:
            self.report(done)

    def close(self) -> None:
        self.connector.close()
