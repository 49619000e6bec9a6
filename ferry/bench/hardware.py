"""What a benchmark ran on: the device's name, the peak memory bandwidth of known GPUs, and the
CPU's measured read bandwidth."""

from __future__ import annotations

import platform
import time

import torch

from ferry.utils import lazy_zeros

# Datasheet HBM bandwidth in bytes/s, matched against torch.cuda.get_device_name() in this order
# (the first pattern whose words all appear in the lower-cased name wins).
KNOWN_PEAK_BANDWIDTH: list[tuple[tuple[str, ...], float]] = [
    (("gh200",), 4.0e12),
    (("h200",), 4.8e12),
    (("h100", "nvl"), 3.9e12),
    (("h100", "pcie"), 2.0e12),
    (("h100",), 3.35e12),  # SXM5 (torch names it "NVIDIA H100 80GB HBM3")
    (("a100", "80gb", "pcie"), 1.935e12),
    (("a100", "80gb"), 2.039e12),  # SXM4
    (("a100",), 1.555e12),
]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def known_peak_bandwidth(name: str) -> float | None:
    """The datasheet peak of a GPU by its torch name, or None for anything else (CPUs included)."""
    low = name.lower()
    for words, bandwidth in KNOWN_PEAK_BANDWIDTH:
        if all(w in low for w in words):
            return bandwidth
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_cpu_read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s the CPU reads with all of torch's threads: the best of `repeats` sums over a
    buffer (by default) larger than the last-level cache a small VM gets to use (a decode step's weights
    stream the same way): a 2-vCPU Xeon guest that reported 480 MiB of L3 read ~50 GB/s up to ~100 MB
    and ~27 GB/s, memory's rate, from 128 MB on (BENCHMARKS.md, session 32). `ferry bench latency` also
    reads the step's own bytes this way, the floor where they fit in that cache.
    The best, not the mean: the floor a step is compared against should be reachable. On huge pages
    (lazy_zeros asks for them), as the CPU's GGUF weights are held (models/weight_arena.py): a sum
    over 4 KiB pages read 26-27 GB/s where huge pages gave 31-32 (the 2-vCPU KVM guest, 2026-11-27),
    and a floor from the slower one would flatter the step."""
    buf = lazy_zeros.zeros((nbytes // 4,), torch.float32, "cpu")
    buf.fill_(1.0)  # page it in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
