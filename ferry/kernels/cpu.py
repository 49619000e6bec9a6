"""CPU kernels compiled on first use with torch's C++ extension builder.

Decode attention over a paged cache is bound by reading K/V; the torch
reference first gathers every sequence's blocks into a padded copy and then
reads that copy again, which at large batches costs several times the
bandwidth. The C++ kernel reads each K/V row once, straight from its block.
The per-token activation quantization of `--quantization int8` is one C++
pass instead of seven torch ops. GGUF block-quantized weights (Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K, Q6_K) run as stored through integer dot products
(gguf_quant_cpu.cpp). If no compiler is available, or
FERRY_CPU_KERNELS=0, callers fall back to the torch paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_module = None
_failed = False


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip package's binary sits in the
    virtualenv's bin/, which is not on PATH when .venv/bin/ferry is run directly."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


EXTENSION_NAME = "ferry_cpu_kernels"

# Instructions that multiply u8 x s8 and accumulate straight into int32.
_INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo: "flags" on x86, "Features" on Arm); empty
    where that is not readable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_int8_dot_product() -> bool:
    """Whether int8 GEMMs accumulate u8 x s8 products without an int16 step (VNNI, AMX). Without
    it (AVX2 alone), oneDNN adds pairs of products in saturating int16 (vpmaddubsw): 255 x 127 x 2
    overflows, so int8 weights must stay within +-63 there (what PyTorch's reduce_range does)."""
    return bool(_INT8_DOT_FLAGS & cpu_flags())


@contextlib.contextmanager
def _build_lock(build_dir: str):
    """One builder at a time, across processes, that survives a builder's death.

    torch's own lock is a file whose existence means "someone is building": a process killed
    mid-build (a SIGKILLed server on its first start) leaves it behind, and every later load
    waits on it for ever. An flock is released by the kernel when its holder dies, so whoever
    holds this one knows a torch lock file still there is stale, and removes it."""
    with open(os.path.join(build_dir, "ferry-build.flock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(build_dir, "lock"))
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def embeds_its_own_libstdcxx(compiler: str) -> bool:
    """Whether `compiler` links a private copy of libstdc++ into a shared library.

    Seen on the GPU machines' image: CXX=/opt/gcc/bin/g++ is a wrapper that links libstdc++
    statically. An extension built so carries a second libstdc++ beside the one torch loaded,
    and its first formatted error message (TORCH_CHECK with a number) crashes the process in
    the uninitialised copy's locale code. One tiny build finds out (well under a second)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.so")
        src = "#include <string>\nstd::string ferry_probe(long v) { return std::to_string(v); }\n"
        try:
            subprocess.run([compiler, "-shared", "-fPIC", "-x", "c++", "-", "-o", out], input=src.encode(),
                           capture_output=True, timeout=120, check=True)  # fmt: skip
            with open(out, "rb") as f:
                return b"libstdc++.so" not in f.read()
        except (OSError, subprocess.SubprocessError):
            return False  # the build itself will say what is wrong with this compiler


@contextlib.contextmanager
def _sound_compiler():
    """Build with $CXX unless it embeds its own libstdc++; then with torch's default, `c++`."""
    cxx = os.environ.get("CXX")
    if not cxx or not embeds_its_own_libstdcxx(cxx):
        yield
        return
    logger.warning("CXX=%s links libstdc++ statically into shared libraries; building the CPU kernels with c++", cxx)
    del os.environ["CXX"]
    try:
        yield
    finally:
        os.environ["CXX"] = cxx


def _cpu_features_line() -> str:
    """This CPU's feature flags as one line, in a fixed order (what the build's name carries)."""
    return " ".join(sorted(cpu_flags()))


def _checkout_key() -> str:
    """Which sources, torch and CPU this build is of. torch keeps one build directory per extension
    name and rebuilds when the source paths change, so two checkouts (or venvs) on one machine
    sharing a name rebuilt each other's kernels in turn, minutes each, and waited on each other's
    build locks (a CI clone beside a working tree timed its servers out that way). The CPU's
    features are in it because the build is -march=native: a cache directory shared by machines
    of different CPUs (a network home, a volume that moves between nodes) would otherwise hand an
    AVX-512 build to a CPU without AVX-512, which dies of SIGILL at its first kernel call."""
    import hashlib
    import platform

    import torch

    where = f"{Path(__file__).resolve().parent}|{torch.__version__}|{platform.machine()}|{_cpu_features_line()}"
    return hashlib.sha256(where.encode()).hexdigest()[:10]


def _isa_flags() -> tuple[str, list[str]]:
    """The extension's name and ISA flags: this CPU's (-march=native: AVX-512/VNNI paths where the CPU
    has them), or with FERRY_CPU_ISA=avx2 the AVX2 paths alone (-mno-avx512f), built under their own
    name so both builds stay cached side by side (the tests compare them)."""
    isa = os.environ.get("FERRY_CPU_ISA", "native")
    if isa == "native":
        return f"{EXTENSION_NAME}_{_checkout_key()}", ["-march=native"]
    if isa == "avx2":
        return f"{EXTENSION_NAME}_avx2_{_checkout_key()}", ["-march=native", "-mno-avx512f"]
    raise ValueError(f"FERRY_CPU_ISA={isa!r}: expected 'native' or 'avx2'")


def cpu_kernels_enabled() -> bool:
    """FERRY_CPU_KERNELS=0 selects the plain torch paths on the CPU (no C++ attention, no oneDNN packing)."""
    return os.environ.get("FERRY_CPU_KERNELS", "1") != "0"


def cpu_kernels():
    """The compiled extension, or None when unavailable (the reason is logged once)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        if not cpu_kernels_enabled():
            _failed = True
            return None
        try:
            from torch.utils.cpp_extension import _get_build_directory, load

            csrc = Path(__file__).parent / "csrc"
            sources = sorted(csrc.glob("*.cpp"))
            name, isa = _isa_flags()
            _put_ninja_on_path()
            logger.info("loading the CPU kernels (compiled on first use, ~45 s on 2 cores)")
            build_dir = _get_build_directory(name, verbose=False)
            with _build_lock(build_dir), _sound_compiler():
                _module = load(
                    name=name,
                    sources=[str(s) for s in sources],
                    # -fopenmp: at::parallel_for is OpenMP inline code; without it the kernel runs
                    # on one thread. The libgomp.so.1 torch already loaded is the one used.
                    extra_cflags=["-O3", *isa, "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=build_dir,
                    verbose=False,
                )
        except Exception as e:  # no compiler / headers: the torch reference still works
            logger.warning("CPU kernels unavailable, using the torch reference attention: %s", e)
            _failed = True
    return _module
