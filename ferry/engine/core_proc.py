"""The EngineCore process: loads the model, then runs the busy loop.

Loop: drain the input socket (add / abort / utility calls), run one engine
step, push its outputs and stats to the API process. It blocks on the socket
only when there is nothing to run (waking every `HEARTBEAT_S` to send stats
and to notice a dead parent), so HTTP never stalls the model and the model
never waits on HTTP. Any exception is fatal: the scheduler may be half-way
through a step, so the process reports `CoreFailed` and exits non-zero, and
the API process turns not-ready and exits too.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from ferry.config import EngineArgs, KVEventsConfig, KVTransferConfig
from ferry.core.block_hash import hash_prompt_blocks
from ferry.engine.kv_connector import Done, ImportJob, KVConnector, TransferResult
from ferry.core.kv_events import KVEventPublisher
from ferry.engine.kv_transfer import KVBlocks, export_blocks, import_blocks
from ferry.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreOutputs,
    CoreReady,
    EngineCoreRequest,
    InputMessage,
    KVTransferDone,
    UtilityCall,
    UtilityResult,
)
from ferry.sampling_params import SamplingParams

logger = logging.getLogger("ferry.engine_core")

HEARTBEAT_S = 0.5


class ParentGone(Exception):
    """The API process died; nobody reads our outputs any more."""


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (a SIGKILLed API process runs no
    cleanup); getppid checks in the loop cover other systems and the start-up window."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _model_bytes(path: str) -> int:
    """The model's size on disk: with its name, what tells two models apart in a shared KV store
    (two fine-tunes under one file name differ in size almost surely; paths differ across hosts)."""
    try:
        if os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
        return os.path.getsize(path)
    except OSError:
        return 0


class EngineCoreProc:
    def __init__(
        self,
        args: EngineArgs,
        input_addr: str,
        output_addr: str,
        kv_events: KVEventsConfig | None = None,
        kv_transfer: KVTransferConfig | None = None,
    ) -> None:
        from ferry.engine.llm_engine import LLMEngine

        self.ctx = zmq.Context(1)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_addr)
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.RCVHWM, 0)
        self.input.connect(input_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.parent_pid = os.getppid()

        self.engine = LLMEngine(args)
        self.core = self.engine.core
        self._warm_up()
        self.publisher: KVEventPublisher | None = None
        if kv_events is not None:
            self.publisher = KVEventPublisher(self.ctx, kv_events)
            self.core.kv.pool.enable_events()  # after the warm-up: its blocks are forgotten
            info = self.engine.info
            info.kv_events_host = self.publisher.host
            info.kv_events_port = self.publisher.port
            info.kv_events_replay_port = self.publisher.replay_port
            logger.info("KV events on tcp://%s:%d (replay %d)", self.publisher.host, self.publisher.port,
                        self.publisher.replay_port)  # fmt: skip
        self.connector: KVConnector | None = None
        self.exports: dict[str, EngineCoreRequest] = {}  # prefill side: requests to send once finished
        self.parked: dict[str, EngineCoreRequest] = {}  # decode side: requests waiting for a Redis pull
        self.parked_at: dict[str, float] = {}
        if kv_transfer is not None:
            self._start_connector(kv_transfer)
        self.send(CoreReady(self.engine.info))
        self.running = True

    def _start_connector(self, config: KVTransferConfig) -> None:
        if self.engine.args.tensor_parallel_size > 1:
            raise ValueError("KV transfer (--kv-transfer / --redis-url) does not support tensor parallelism yet")
        info, kv = self.engine.info, self.core.kv
        k0 = self.engine.runner.kv_caches[0][0]
        _, bs, kvh, d = k0.shape
        layers = len(self.engine.runner.kv_caches)
        namespace = f"{os.path.basename(info.model_path)}:{_model_bytes(info.model_path)}:{layers}x{kvh}x{d}x{bs}"
        max_payload = kv.pool.num_blocks * layers * 2 * bs * kvh * d * 4
        self.connector = KVConnector(config, self.ctx, namespace, max_payload)
        cached = kv.pool.cached
        self.connector.set_lookup(lambda h: h in cached)
        info.kv_role = config.role
        info.kv_transfer = config.transport
        info.kv_receiver = self.connector.receiver_addr
        info.kv_redis = self.connector.redis is not None
        logger.info("KV transfer: role %s, sends by %s, receives on %s%s", config.role, config.transport or "-",
                    info.kv_receiver or "-", ", pulls from Redis" if info.kv_redis else "")  # fmt: skip

    def _warm_up(self) -> None:
        """Run one full-budget prefill and a few decode steps so first requests don't pay for
        lazy initialisation (kernel builds, allocator growth); then forget them in the stats."""
        info = self.engine.info
        n = max(1, min(self.engine.args.max_num_batched_tokens, info.max_model_len - 8, 512))
        ids = [(i * 7919) % info.vocab_size for i in range(n)]
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        self.core.add_request(EngineCoreRequest("__warmup__", ids, params, 4))
        t0 = time.perf_counter()
        while self.core.has_unfinished_requests():
            self.core.step()
        self.core.kv.pool.reset_prefix_cache()
        self.core.kv.prefix_queries = self.core.kv.prefix_hits = 0
        logger.info("warm-up (%d-token prefill + 3 decode steps) took %.2fs", n, time.perf_counter() - t0)

    def send(self, msg) -> None:
        # A PUSH socket whose peer is gone blocks a plain send forever: send without blocking
        # and, while the socket is mute, check that the API process is still there.
        data = self.encoder.encode(msg)
        while True:
            try:
                self.output.send(data, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                self.check_parent()
                self.output.poll(500, zmq.POLLOUT)

    def check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            raise ParentGone()

    def handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            for r in msg.requests:
                self.add_request(r)
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.parked.pop(rid, None)
                self.parked_at.pop(rid, None)
                self.exports.pop(rid, None)
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, UtilityCall):
            value, error = None, None
            if msg.method == "ping":
                pass
            elif msg.method == "stats":
                value = self.core.stats()
            elif msg.method == "reset_prefix_cache":
                if not self.core.kv.pool.reset_prefix_cache():
                    error = "cannot reset the prefix cache while requests hold blocks"
            elif msg.method == "shutdown":
                self.running = False
            else:
                error = f"unknown method {msg.method!r}"
            self.send(UtilityResult(msg.call_id, error is None, value, error))

    # -- KV transfer (prefill/decode disaggregation) ----------------------------------

    def add_request(self, r: EngineCoreRequest) -> None:
        if r.kv_export:
            if self.connector is None:
                self.send(KVTransferDone(r.request_id, "sent", False, error="this worker has no --kv-transfer"))
            else:
                self.exports[r.request_id] = r
        if self.connector is not None and self.connector.redis is not None and self.core.kv.enable_prefix_caching:
            # Blocks another worker computed may be in Redis: fetch the ones missing here first.
            bs = self.core.kv.block_size
            usable = (len(r.prompt_token_ids) + len(r.prefilled_token_ids) - 1) // bs
            hashes = hash_prompt_blocks(r.prompt_token_ids, bs)[:usable]
            missing = self.connector.missing_prefix(hashes)
            if missing:
                start = len(hashes) - len(missing)
                self.parked[r.request_id] = r
                self.parked_at[r.request_id] = time.monotonic()
                self.connector.pull(r.request_id, missing, hashes[start - 1] if start else None)
                return
        self.core.add_request(r)

    def export_finished(self, outputs) -> None:
        """Prefill side: send the blocks of requests that asked for it, now cached after their prefill."""
        for out in outputs:
            if out.finish_reason is None or out.request_id not in self.exports:
                continue
            r = self.exports.pop(out.request_id)
            if out.finish_reason == "abort":
                continue
            hashes = hash_prompt_blocks(r.prompt_token_ids, self.core.kv.block_size)
            payload = export_blocks(self.core.kv, self.engine.runner.kv_caches, hashes,
                                    encoding=self.connector.config.encoding)  # fmt: skip
            self.connector.send(r.request_id, payload, r.kv_target)

    def _import(self, payload: KVBlocks) -> int:
        return import_blocks(self.core.kv, self.engine.runner.kv_caches, payload)

    def process_kv_transfers(self) -> None:
        if self.connector is None:
            return
        for ev in self.connector.drain():
            if isinstance(ev, ImportJob):
                n, error = 0, ev.error
                if ev.payload is not None:
                    try:
                        n = self._import(ev.payload)
                    except Exception as e:  # a peer's bad payload must not take the core down
                        error = f"{type(e).__name__}: {e}"
                self.connector.receiver.reply(ev.identity, Done(ev.transfer_id, error is None, n, error))
                nbytes = ev.payload.num_bytes if ev.payload is not None else 0
                self.send(KVTransferDone(ev.transfer_id, "received", error is None, n, nbytes,
                                         time.monotonic() - ev.received_at, error))  # fmt: skip
            elif isinstance(ev, TransferResult):
                error, n = ev.error, ev.num_blocks
                if ev.payloads:  # a Redis pull: import, then the parked request may run
                    try:
                        n = self._import(KVBlocks.join(ev.payloads))
                    except Exception as e:  # a bad stored value must not take the core down
                        error, n = f"{type(e).__name__}: {e}", 0
                if ev.payloads is None or error is not None or n:  # a pull that found nothing is no transfer
                    self.send(KVTransferDone(ev.request_id, ev.direction, ev.ok and error is None, n, ev.num_bytes,
                                             ev.seconds, error))  # fmt: skip
                r = self.parked.pop(ev.request_id, None)
                self.parked_at.pop(ev.request_id, None)
                if r is not None:
                    self.core.add_request(r)
        if self.parked_at:  # a pull stuck past the timeout: run the request without it
            limit = time.monotonic() - self.connector.config.timeout
            for rid in [rid for rid, t in self.parked_at.items() if t < limit]:
                del self.parked_at[rid]
                self.core.add_request(self.parked.pop(rid))

    def publish_kv_events(self) -> None:
        if self.publisher is not None:
            self.publisher.publish(self.core.kv.pool.events.take())

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        if self.publisher is not None:
            poller.register(self.publisher.replay, zmq.POLLIN)
        if self.connector is not None:
            poller.register(self.connector.wake, zmq.POLLIN)
        last_heartbeat = time.monotonic()
        while self.running:
            busy = self.core.has_unfinished_requests()
            timeout_ms = 0 if busy else int(HEARTBEAT_S * 1000)
            while ready := dict(poller.poll(timeout_ms)):
                if self.publisher is not None and self.publisher.replay in ready:
                    # A bounded number per pass: a flood of replay requests must not starve the steps.
                    self.publisher.serve_replays(lambda: list(self.core.kv.pool.cached), max_requests=8)
                if self.input not in ready:
                    break
                self.handle(self.decoder.decode(self.input.recv(copy=False).buffer))
                timeout_ms = 0
            self.process_kv_transfers()
            self.publish_kv_events()  # e.g. a reset_prefix_cache call, imported blocks
            if not self.running:
                break
            if self.core.has_unfinished_requests():
                outputs = self.core.step()
                if self.exports:
                    self.export_finished(outputs)
                self.publish_kv_events()
                self.send(CoreOutputs(outputs, self.core.stats()))
                last_heartbeat = time.monotonic()
            elif time.monotonic() - last_heartbeat >= HEARTBEAT_S:
                self.check_parent()
                self.send(CoreOutputs([], self.core.stats()))
                last_heartbeat = time.monotonic()

    def close(self) -> None:
        self.engine.shutdown()
        if self.connector is not None:
            self.connector.close()
        if self.publisher is not None:
            self.publisher.close()
        self.output.close()
        self.input.close()
        self.ctx.term()


def run_engine_core(
    args: EngineArgs,
    input_addr: str,
    output_addr: str,
    log_level: int = logging.INFO,
    kv_events: KVEventsConfig | None = None,
    kv_transfer: KVTransferConfig | None = None,
) -> None:
    """Entry point of the core process (multiprocessing target)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    # The API process owns signals: SIGINT from a terminal goes to the whole group, and the
    # API process decides when the core stops (after draining), so ignore it here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()
    proc = None
    try:
        proc = EngineCoreProc(args, input_addr, output_addr, kv_events, kv_transfer)
        proc.run()
    except ParentGone:
        logger.error("the API process is gone; exiting")
        sys.exit(1)
    except Exception as e:  # fatal by design, see the module docstring
        logger.error("EngineCore failed:\n%s", traceback.format_exc())
        try:
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(output_addr)
            if sock.poll(2000, zmq.POLLOUT):  # never block on an API process that is gone too
                sock.send(msgspec.msgpack.encode(CoreFailed(f"{type(e).__name__}: {e}")), flags=zmq.NOBLOCK)
            sock.close()
        finally:
            sys.exit(1)
    finally:
        if proc is not None:
            proc.close()
