"""`ferry bench latency`: decode time per output token (TPOT) at fixed batch sizes, and the
fraction of the device's memory bandwidth it reaches.

For each batch size B: B requests of `--input-len` random token ids are prefilled, then
decode together for `--output-len` tokens (greedy, EOS ignored). TPOT is the mean wall time
of the steps in which all B decode and nothing prefills. A decode step must read every weight
once (the embedding only for the B rows it gathers; the output head in full) plus the K/V of
every context token, so

    bandwidth fraction = (weight bytes + KV bytes read per step) / TPOT / peak bandwidth

with the peak from `--peak-bandwidth` (bytes/s), the datasheet value of a known GPU, or on a
CPU its measured read bandwidth (ferry/bench/hardware.py); 1/fraction is the step's distance
from its bytes floor. A CPU's read rate moves with what else shares the host's memory (a 2-vCPU
VM read 45-85 GB/s over one day), so it is measured right before and right after each batch
size's timed steps and the floor takes the faster of the two: the comparison is paired in time
and errs against the step. A 256 MB buffer reads at memory's rate; a step whose own bytes fit in the
last-level cache can beat that (a 2-vCPU Xeon guest read ~50 GB/s up to ~100 MB and ~27 from 128 MB on,
while SmolLM2's batch-1 step reads ~104 MB), so on a CPU a buffer of the step's own size is read after
the run too, and the step's distance from that floor printed beside the other. Prefill tok/s counts
the steps that prefilled the B prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import time
from dataclasses import asdict

import torch

from ferry.bench.hardware import device_name, known_peak_bandwidth, measure_cpu_read_bandwidth, synchronize
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.layers.linear import Linear
from ferry.models.config import ModelConfig
from ferry.models.dummy_weights import weight_shapes
from ferry.models.weight_memory import held_weight_bytes, process_rss_bytes
from ferry.sampling_params import SamplingParams
from ferry.worker.memory import kv_bytes_per_token

logger = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256], metavar="B")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--warmup-steps", type=int, default=4, help="untimed decode steps per batch size first")
    p.add_argument(
        "--peak-bandwidth",
        type=float,
        default=None,
        help="the device's peak memory bandwidth in bytes/s (default: the datasheet value of a known GPU, "
        "e.g. 3.35e12 for an H100 SXM, 4.8e12 for an H200; none on a CPU)",
    )
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", default=None, help="also write the results to this file")


def weight_bytes_per_step(cfg: ModelConfig, dtype: torch.dtype, batch: int, quantization: str | None = None) -> int:
    """Bytes of parameters one decode step of `batch` rows reads: every weight once, the input
    embedding only for the rows gathered, the output head (the embedding, if tied) in full; of a
    mixture of experts' routed experts at most batch x top_k per layer (the bound: tokens that
    share an expert read it once)."""
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    touched = min(1.0, batch * cfg.num_experts_per_tok / cfg.num_experts) if cfg.num_experts else 1.0
    for name, shape in weight_shapes(cfg):
        numel = 1
        for s in shape:
            numel *= s
        if ".mlp.experts." in name:
            numel = int(numel * touched)
        # int8 quantizes every projection and the output head (not the embedding lookup or norms).
        size = 1 if quantization == "int8" and len(shape) == 2 and name != "model.embed_tokens.weight" else elem
        if name == "model.embed_tokens.weight":
            total += min(batch, cfg.vocab_size) * cfg.hidden_size * elem
            if cfg.tie_word_embeddings:
                total += numel * (1 if quantization == "int8" else elem)
        else:
            total += numel * size
    return total


def model_weight_bytes_per_step(model, batch: int) -> int:
    """The same, read off a loaded model whose weights run GGUF-quantized: each projection's
    blocks as held, the embedding's gathered rows only, and the head in full. Any of them may
    have stayed a float parameter (a GGUF can store some tensors as F16/F32)."""
    embed = model.embed_tokens
    floats = [p for p in model.parameters() if p is not embed.weight]
    total = sum(p.numel() * p.element_size() for p in floats)  # norms, and any F16/F32 matrix
    total += sum(sum(w.nbytes for w in m.gguf) for m in model.modules() if isinstance(m, Linear) and m.gguf)
    if embed.gguf is not None:
        table_bytes, rows = embed.gguf.nbytes, embed.gguf.out_features
    else:
        table_bytes, rows = embed.weight.numel() * embed.weight.element_size(), embed.weight.shape[0]
    total += table_bytes * min(batch, rows) // rows  # the gathered rows
    if model.lm_head is None:
        total += table_bytes  # the tied head reads the whole table
    elif model._gguf_lm_head is not None:
        total += model._gguf_lm_head.nbytes
    return total


def cache_sized_for(eargs: EngineArgs, num_seqs: int, tokens_per_seq: int) -> EngineArgs:
    """`eargs` with a KV cache of what `num_seqs` sequences of `tokens_per_seq` tokens need, unless the
    user sized it. For benches that build two engines over one loaded model: on a GPU the second
    engine's memory profile sees the first one's cache as used memory, and the default (a share of
    the whole GPU) leaves it nothing (a verify-cost run on an H100 failed so, 2026-11-26)."""
    if eargs.num_kv_blocks is not None or eargs.kv_cache_memory_bytes is not None:
        return eargs
    blocks = num_seqs * -(-tokens_per_seq // eargs.block_size) + 16
    if eargs.max_model_len:  # the engine refuses a context its cache cannot hold
        blocks = max(blocks, -(-eargs.max_model_len // eargs.block_size))
    return dataclasses.replace(eargs, num_kv_blocks=blocks)


def timed_engine(args: EngineArgs, loaded) -> LLMEngine:
    """An engine over an already loaded model (`LoadedModel`) for a timed run, its heap frozen as a
    server's core's is: an engine over a shared model skips that by default, and a full collection
    mid-run is a ~0.2 s stall."""
    return LLMEngine(args, model=loaded.model, tokenizer=loaded.tokenizer, device=loaded.device,
                     dtype=loaded.dtype, freeze_heap=True)  # fmt: skip


def warm_up(engine: LLMEngine, requests: list[tuple[list[int], int]]) -> None:
    """One short request through the engine before a timed or profiled run (first-call allocations,
    thread pools, kernel compiles): the first request's first 16 tokens reversed, so that it fills no
    block a timed request could hit."""
    warm = requests[0][0][:16][::-1]
    engine.add_request("warmup", {"prompt_token_ids": warm}, SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()


def _requests(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    lo, hi = (100, vocab - 100) if vocab > 300 else (0, vocab)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str,
              loras: list[str | None] | None = None) -> list[tuple[object, float]]:  # fmt: skip
    """Run the prompts to completion; returns (StepRecord, wall seconds) of every step. `loras`: per
    prompt, the LoRA adapter it runs under (None: the base model).

    Steps are timed back to back (one device sync, at the end), so an engine that overlaps
    a step's host work with the previous step's device work is not slowed down by the timing.
    """
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params, lora_request=loras[i] if loras else None)
    records: list = []
    engine.core.step_records = records
    ends: list[tuple[int, float]] = []  # (records so far, time) after every step
    synchronize(engine.device)
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            engine.step()
            ends.append((len(records), time.perf_counter()))
        synchronize(engine.device)
        ends[-1] = (ends[-1][0], time.perf_counter())
    finally:
        engine.core.step_records = None
    steps, prev, seen = [], start, 0
    for n, t in ends:
        if n > seen:  # a step that ran the model (else it only flushed outputs)
            steps.append((records[n - 1], t - prev))
            seen = n
        prev = t
    return steps


def prefill_tok_per_s(steps: list[tuple[object, float]]) -> float:
    """Prompt tokens per second over run_batch's steps that carried prompt tokens (with the decodes of
    the requests already prefilled beside them, as a serving step has them)."""
    mixed = [(rec, dt) for rec, dt in steps if rec.num_prefill_tokens]
    seconds = sum(dt for _, dt in mixed)
    return sum(rec.num_prefill_tokens for rec, _ in mixed) / seconds if seconds > 0 else float("nan")


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def main(args: argparse.Namespace) -> int:
    eargs = EngineArgs.from_cli_args(args)
    eargs.model = args.model
    sizes = args.batch_sizes
    if min(sizes) < 1 or args.input_len < 1 or args.output_len < 2:
        raise ValueError("--batch-sizes and --input-len must be >= 1, --output-len >= 2")
    if max(sizes) > eargs.max_num_seqs:
        raise ValueError(f"batch size {max(sizes)} exceeds --max-num-seqs {eargs.max_num_seqs}; raise it")
    engine = LLMEngine(eargs)
    cfg, dtype, device = engine.model_config, engine.dtype, engine.device
    if args.input_len + args.output_len > engine.max_model_len:
        raise ValueError(
            f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds max_model_len "
            f"{engine.max_model_len}"
        )
    name = device_name(device)
    peak = args.peak_bandwidth or known_peak_bandwidth(name)
    peak_src = "--peak-bandwidth" if args.peak_bandwidth else ("datasheet" if peak else None)
    probe = peak is None and device.type == "cpu"  # the bytes floor of a CPU step: its measured read rate
    if probe:
        peak_src = "measured: tensor.sum over 256 MB, before and after each batch size"
    kv_tok = kv_bytes_per_token(cfg, engine.kv_cache_dtype)
    print(
        f"model {eargs.model or 'default'} ({cfg.architecture}, {cfg.num_hidden_layers} layers), {dtype} on {name}; "
        f"prompt {args.input_len}, output {args.output_len} tokens; peak bandwidth "
        + (f"{peak:.3g} B/s ({peak_src})" if peak else peak_src if probe else "n/a (pass --peak-bandwidth)")
    )
    held = held_weight_bytes(engine.model)
    rss = process_rss_bytes()
    print(
        f"weights held ({engine.model.quantization or dtype}): {_fmt_bytes(held['total'])} = projections "
        f"{_fmt_bytes(held['projections'])} + head {_fmt_bytes(held['head'])} + embedding "
        f"{_fmt_bytes(held['embedding'])} + norms {_fmt_bytes(held['other'])}"
        + (f"; process RSS {_fmt_bytes(rss)} (KV cache included)" if rss is not None else "")
    )
    result: dict = {
        "weight_bytes_held": held,
        "process_rss_bytes": rss,
        "model": eargs.model,
        "load_format": eargs.load_format,
        "dtype": str(dtype),
        "kv_cache_dtype": str(engine.kv_cache_dtype),
        "device": str(device),
        "device_name": name,
        "peak_bandwidth": peak,
        "peak_bandwidth_source": peak_src,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "engine_args": asdict(eargs),
        "batches": [],
    }
    populator = getattr(engine.runner, "kv_populator", None)
    if populator is not None:  # --kv-cache-prefault: time as a server does once its pages are in
        t0 = time.perf_counter()
        populator.wait()
        waited = time.perf_counter() - t0
        print(
            f"KV cache pages faulted in ahead (--kv-cache-prefault): {_fmt_bytes(populator.populated_bytes)} "
            f"of {_fmt_bytes(populator.total_bytes)}, waited {waited:.1f} s"
            + (f" (stopped: {populator.error})" if populator.error else "")
        )
        result["kv_prefault"] = {"bytes": populator.populated_bytes, "waited_s": waited, "error": populator.error}
    rng = random.Random(args.bench_seed)
    for batch in sizes:
        if args.warmup_steps > 0:  # allocator growth, kernel selection, graph capture for this batch size
            run_batch(engine, _requests(rng, batch, args.input_len, cfg.vocab_size), args.warmup_steps + 1, "warm")
        prompts = _requests(rng, batch, args.input_len, cfg.vocab_size)
        before = measure_cpu_read_bandwidth() if probe else None
        stats0 = engine.get_stats()
        steps = run_batch(engine, prompts, args.output_len, f"b{batch}")
        if probe:
            bandwidth_around = (before, measure_cpu_read_bandwidth())
            peak = max(bandwidth_around)
        preempted = engine.get_stats().num_preemptions - stats0.num_preemptions
        decode = [(r, dt) for r, dt in steps if r.num_prefill_tokens == 0 and r.num_decodes == batch]
        if not decode:
            raise ValueError(f"batch {batch}: no step decoded all {batch} requests together (KV cache too small?)")
        secs = [dt for _, dt in decode]
        tpot = statistics.fmean(secs)
        if engine.model.quantization == "gguf":
            w_bytes = model_weight_bytes_per_step(engine.model, batch)
        else:
            w_bytes = weight_bytes_per_step(cfg, dtype, batch, engine.model.quantization)
        kv_bytes = statistics.fmean(r.decode_context_tokens for r, _ in decode) * kv_tok
        achieved = (w_bytes + kv_bytes) / tpot
        fraction = achieved / peak if peak else None
        # The same read over the step's own bytes: the floor where they fit in the cache.
        own_size_rate = measure_cpu_read_bandwidth(max(int(w_bytes + kv_bytes), 1 << 20)) if probe else None
        prefill_tokens = sum(r.num_prefill_tokens for r, _ in steps)
        prefill_s = sum(dt for r, dt in steps if r.num_prefill_tokens)
        row = {
            "batch_size": batch,
            "decode_steps": len(decode),
            "tpot_ms": tpot * 1e3,
            "tpot_p50_ms": statistics.median(secs) * 1e3,
            "output_tok_per_s": batch / tpot,
            "prefill_s": prefill_s,
            "prefill_tok_per_s": prefill_tokens / prefill_s if prefill_s else None,
            "weight_bytes_per_step": w_bytes,
            "kv_bytes_per_step": kv_bytes,
            "bandwidth_bytes_per_s": achieved,
            "bandwidth_fraction": fraction,
            "peak_bandwidth": peak,
            "preemptions": preempted,
        }
        if probe:
            row["measured_bandwidth_before_after"] = bandwidth_around
            row["measured_bandwidth_at_step_size"] = own_size_rate
            row["x_floor_at_step_size"] = own_size_rate / achieved
        result["batches"].append(row)
        print(
            f"B={batch:4d}: TPOT {row['tpot_ms']:8.3f} ms (p50 {row['tpot_p50_ms']:.3f}) over {len(decode)} steps, "
            f"{row['output_tok_per_s']:10.1f} tok/s; reads {_fmt_bytes(w_bytes)} weights + {_fmt_bytes(kv_bytes)} KV "
            f"per step = {_fmt_bytes(achieved)}/s"
            + (
                f" = {fraction * 100:.1f}% of peak ({1 / fraction:.2f}x the bytes floor"
                + (
                    f" at {peak / 1e9:.1f} GB/s; read {bandwidth_around[0] / 1e9:.1f} / {bandwidth_around[1] / 1e9:.1f}"
                    f" GB/s before / after; {row['x_floor_at_step_size']:.2f}x at the step's own"
                    f" {_fmt_bytes(w_bytes + kv_bytes)}, read at {own_size_rate / 1e9:.1f} GB/s)"
                    if probe
                    else ")"
                )
                if fraction
                else ", fraction of peak n/a"
            )
            + (f"; prefill {row['prefill_tok_per_s']:.0f} tok/s" if prefill_s else "")
            + (f" ({preempted} preemptions)" if preempted else "")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0
