"""`ferry bench throughput --torch-profile N`: where a step's time goes, by operator, instead of the
timed run.

The workload's requests are queued at once, as the timed run queues them. Then, after three steps that
compile what a full-size step needs, torch.profiler records two windows of N engine steps each: the
next N steps (every one of them carries prompt tokens while the queue is long: chunked prefill beside
the decodes of the requests already started), and, once no prompt is left to prefill, N steps that
only decode. Each window prints its kernels by device time (CUDA) or its operators by self CPU time
(elsewhere), with their counts per step, and the wall time per step against the device's busy time: a
step whose device sits idle most of its wall time is bound by the host (launches, Python, syncs), not
by its kernels.

On the CPU ferry's C++ kernels (GGUF dots, attention, the whole-step decode) are pybind calls, not
dispatcher operators: the table lists the torch operators around them, and the header says how much
of the wall time those take. The profiler's own overhead inflates the host side; the timed run
without `--torch-profile` gives the figures to report. This only says where to look.
"""

from __future__ import annotations

import time

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ferry.bench.hardware import synchronize
from ferry.bench.latency import warm_up
from ferry.engine.llm_engine import LLMEngine
from ferry.sampling_params import SamplingParams

# Steps that only decode, in a row, before the second window opens: the prefills have drained.
_SETTLED = 3


def _window(engine: LLMEngine, records: list, num_steps: int, on_cuda: bool) -> tuple[profile, list, float]:
    """Profile the next `num_steps` steps that run the model; (profiler, their records, wall seconds)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    first = len(records)
    synchronize(engine.device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        while len(records) - first < num_steps and engine.has_unfinished_requests():
            engine.step()
        synchronize(engine.device)
        wall = time.perf_counter() - t0
    return prof, records[first:], wall


def _report(name: str, prof: profile, steps: list, wall: float, on_cuda: bool, row_limit: int) -> dict:
    n = max(len(steps), 1)
    key = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key) > 0]
    if on_cuda:  # the kernels and copies themselves: the CPU op that launched one carries its time too
        events = [e for e in events if e.device_type == DeviceType.CUDA]
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    busy = sum(getattr(e, key) for e in events) / 1e6 if on_cuda else None
    prefill_tokens = sum(r.num_prefill_tokens for r in steps)
    decodes = sum(r.num_decodes for r in steps)
    head = (f"{name}: {len(steps)} steps, {prefill_tokens / n:.0f} prompt tokens and {decodes / n:.0f} decode rows "
            f"a step; {wall / n * 1e3:.2f} ms wall a step (profiled)")  # fmt: skip
    if busy is not None:
        head += f", device busy {busy / n * 1e3:.2f} ms a step ({busy / wall:.0%} of wall)"
    else:  # ferry's C++ CPU kernels are pybind calls, not dispatcher operators: the profiler does not see them
        ops = sum(e.self_cpu_time_total for e in events) / 1e6
        head += (f"; torch operators {ops / n * 1e3:.2f} ms of it ({ops / max(wall, 1e-9):.0%}), the rest ferry's "
                 "C++ kernels (not operators) and Python")  # fmt: skip
    print(head)
    total = sum(getattr(e, key) for e in events) or 1
    print(f"  {'operator':60s} {'ms/step':>8s} {'share':>6s} {'calls/step':>10s}")
    rows = []
    for e in events[:row_limit]:
        t = getattr(e, key)
        rows.append({"name": e.key, "ms_per_step": t / 1e3 / n, "share": t / total, "calls_per_step": e.count / n})
        print(f"  {e.key[:60]:60s} {t / 1e3 / n:8.3f} {t / total:6.1%} {e.count / n:10.1f}")
    return {"steps": len(steps), "prompt_tokens_per_step": prefill_tokens / n, "decode_rows_per_step": decodes / n,
            "wall_ms_per_step": wall / n * 1e3, "device_busy_ms_per_step": None if busy is None else busy / n * 1e3,
            "time_key": key, "top": rows}  # fmt: skip


def run(engine: LLMEngine, requests: list[tuple[list[int], int]], num_steps: int, row_limit: int = 25) -> dict:
    """Queue `requests` ((prompt ids, output tokens) each), profile the two windows of `num_steps` (>= 1,
    checked by the command) steps, abort the rest."""
    on_cuda = engine.device.type == "cuda"
    engine.runner.profile = False  # its per-phase syncs would idle the device between phases
    warm_up(engine, requests)  # compile, capture and allocate outside the windows
    engine.core.step_records = records = []
    ids = [f"profile-{i}" for i in range(len(requests))]
    for rid, (prompt, n) in zip(ids, requests):
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=n,
                                                                             ignore_eos=True))  # fmt: skip
    result = {}
    try:
        for _ in range(_SETTLED):  # the first full-size prefill steps compile their kernels' shapes, unprofiled
            engine.step()
        prof, steps, wall = _window(engine, records, num_steps, on_cuda)
        result["prefill_steps"] = _report("steps with prefill", prof, steps, wall, on_cuda, row_limit)
        while engine.has_unfinished_requests() and not (
            len(records) >= _SETTLED and all(r.num_prefill_tokens == 0 for r in records[-_SETTLED:])
        ):
            engine.step()
        if engine.has_unfinished_requests():
            prof, steps, wall = _window(engine, records, num_steps, on_cuda)
            result["decode_steps"] = _report("decode-only steps", prof, steps, wall, on_cuda, row_limit)
        else:
            print("decode-only steps: none left to profile (every request finished during the prefills)")
    finally:
        engine.core.step_records = None
        engine.abort_request([rid for rid in ids if rid in engine.output_processor.requests])
        while engine.has_unfinished_requests():
            engine.step()
    return result
