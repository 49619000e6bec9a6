"""The EngineCore process: builds the engine core, then runs the busy loop.

Loop: drain the input socket (add / abort / utility calls), run one engine
step, push its outputs and stats to the API process. It blocks on the socket
only when there is nothing to run (waking every `HEARTBEAT_S` to send stats
and to notice a dead parent), so HTTP never stalls the model and the model
never waits on HTTP. Any exception is fatal: the scheduler may be half-way
through a step, so the process reports `CoreFailed` and exits non-zero, and
the API process turns not-ready and exits too. KV events and KV transfers
(ferry/core/kv_events.py, ferry/kv_transfer/) are served from the same loop.
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
from ferry.core.block_hash import salt_fingerprint
from ferry.core.kv_events import KVEventPublisher
from ferry.engine.builder import build_engine_core
from ferry.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreOutputs,
    CoreReady,
    EngineCoreRequest,
    InputMessage,
    UtilityCall,
    UtilityResult,
    utility_error_kind,
)
from ferry.kv_transfer.coordinator import KVTransferCoordinator
from ferry.kv_transfer.outcome import KVTransferDone
from ferry.models.paths import resolve_model_path
from ferry.sampling_params import SamplingParams
from ferry.utils.deployment_secret import block_hash_salt
from ferry.utils.process import die_with_parent

logger = logging.getLogger("ferry.engine_core")

HEARTBEAT_S = 0.5


class ParentGone(Exception):
    """The API process died; nobody reads our outputs any more."""


class EngineCoreProc:
    def __init__(
        self,
        args: EngineArgs,
        input_addr: str,
        output_addr: str,
        kv_events: KVEventsConfig | None = None,
        kv_transfer: KVTransferConfig | None = None,
        spawned_at: float | None = None,
    ) -> None:
        started = time.time()
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

        self.args = args
        self.core = build_engine_core(args, tokenizer=False)  # its API process tokenizes
        # A deployment secret salts every block hash that may leave this process (core/block_hash.py).
        secret = (kv_events and kv_events.secret) or (kv_transfer and kv_transfer.secret)
        self.core.kv.block_hash_salt = block_hash_salt(secret)
        self.core.info.block_hash_salt = salt_fingerprint(self.core.kv.block_hash_salt)
        t0 = time.perf_counter()
        self._warm_up()
        startup = self.core.info.startup_seconds
        startup["warm_up"] = time.perf_counter() - t0
        if spawned_at is not None:  # the interpreter's start and the imports, until this process ran
            startup["core_process_start"] = max(0.0, started - spawned_at)
        self.publisher: KVEventPublisher | None = None
        if kv_events is not None:
            self.publisher = KVEventPublisher(self.ctx, kv_events)
            self.core.kv.pool.enable_events()  # after the warm-up: its blocks are forgotten
            info = self.core.info
            info.kv_events_host = self.publisher.host
            info.kv_events_port = self.publisher.port
            info.kv_events_replay_port = self.publisher.replay_port
            logger.info("KV events on tcp://%s:%d (replay %d)", self.publisher.host, self.publisher.port,
                        self.publisher.replay_port)  # fmt: skip
        self.transfers: KVTransferCoordinator | None = None
        if kv_transfer is not None:
            self.transfers = self._start_transfers(kv_transfer)
        if spawned_at is not None:
            startup["core_total"] = time.time() - spawned_at
        self.send(CoreReady(self.core.info))
        self.running = True

    def _start_transfers(self, config: KVTransferConfig) -> KVTransferCoordinator:
        if self.args.world_size > 1:
            raise ValueError("KV transfer (--kv-transfer / --redis-url) does not support tensor or pipeline "
                             "parallelism yet")  # fmt: skip
        info = self.core.info
        # The files, not the argument (None for the bundled model): what names the model to peers.
        model_path = resolve_model_path(self.args.model, self.args.load_format)
        transfers = KVTransferCoordinator(config, self.ctx, self.core.kv, self.core.runner.kv_caches, model_path,
                                          self.send, self.core.runner.lora_key)  # fmt: skip
        info.kv_role = config.role
        info.kv_transfer = config.transport
        info.kv_receiver = transfers.receiver_addr
        info.kv_redis = transfers.pulls
        return transfers

    def _warm_up(self) -> None:
        """Run a prefill and a few decode steps so first requests don't pay for lazy initialisation
        (kernel builds, allocator growth); then forget them in the stats. On a GPU the prefill is
        the step budget's (up to 512 tokens: kernels compile per shape); on the CPU 64 tokens: there
        a 512-token one was ~0.6 s of compute, and the first 512-token request after /ready is no
        slower after the short one that `ferry bench startup` can tell (BENCHMARKS.md, session 44)."""
        info = self.core.info
        longest = 512 if self.core.runner.device.type != "cpu" else 64
        n = max(1, min(self.args.max_num_batched_tokens, info.max_model_len - 8, longest))
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
            if self.transfers is not None:
                self.transfers.abort(msg.request_ids)
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, UtilityCall):
            value, error, kind, param = None, None, None, None
            if msg.method == "ping":
                pass
            elif msg.method == "stats":
                value = self.core.stats()
            elif msg.method == "reset_prefix_cache":
                if not self.core.kv.pool.reset_prefix_cache():
                    error = "cannot reset the prefix cache while requests hold blocks"
            elif msg.method in ("add_lora", "remove_lora"):
                try:
                    if msg.method == "add_lora":
                        name, path, *how = msg.args
                        self.core.add_lora(name, path, replace=how == ["replace"])
                        value = self.core.info.lora_digests.get(name)
                    else:
                        self.core.remove_lora(*msg.args)
                except Exception as e:  # refused (InvalidParameterError), or malformed args: the loop goes on
                    if not isinstance(e, ValueError):
                        logger.exception("utility call %s", msg.method)
                    error, kind, param = str(e), utility_error_kind(e), getattr(e, "param", None)
            elif msg.method == "shutdown":
                self.running = False
            else:
                error = f"unknown method {msg.method!r}"
            self.send(UtilityResult(msg.call_id, error is None, value, error, kind, param))

    def add_request(self, r: EngineCoreRequest) -> None:
        if self.transfers is None:
            if r.kv_export:
                self.send(KVTransferDone(r.request_id, "sent", False, error="this worker has no --kv-transfer"))
            self.core.add_request(r)
        elif self.transfers.admit(r):  # else parked until its blocks are pulled
            self.core.add_request(r)

    def process_kv_transfers(self) -> None:
        if self.transfers is not None:
            for r in self.transfers.poll():
                self.core.add_request(r)

    def publish_kv_events(self) -> None:
        if self.publisher is not None:
            self.publisher.publish(self.core.kv.pool.events.take())

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        if self.publisher is not None:
            poller.register(self.publisher.replay, zmq.POLLIN)
        if self.transfers is not None:
            poller.register(self.transfers.wake, zmq.POLLIN)
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
                if self.transfers is not None:
                    self.transfers.export_finished(outputs)
                self.publish_kv_events()
                self.send(CoreOutputs(outputs, self.core.stats(self.core.step_tokens)))
                last_heartbeat = time.monotonic()
            elif time.monotonic() - last_heartbeat >= HEARTBEAT_S:
                self.check_parent()
                self.send(CoreOutputs([], self.core.stats()))
                last_heartbeat = time.monotonic()

    def close(self) -> None:
        self.core.shutdown()
        if self.transfers is not None:
            self.transfers.close()
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
    spawned_at: float | None = None,
) -> None:
    """Entry point of the core process (multiprocessing target); `spawned_at`: the API process's
    time.time() when it started this process."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    # The API process owns signals: SIGINT from a terminal goes to the whole group, and the
    # API process decides when the core stops (after draining), so ignore it here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent()  # a SIGKILLed API process runs no cleanup
    proc = None
    try:
        proc = EngineCoreProc(args, input_addr, output_addr, kv_events, kv_transfer, spawned_at)
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
