"""ferry's CPU kernels as a commit had them, built as a second extension beside this tree's, so the
A/B scripts (cpu_attention_sweep.py, gguf_cpu_sweep.py: --against REV) time old and new in one
process and the same minute."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

CSRC = "ferry/kernels/csrc"
ROOT = Path(__file__).resolve().parent.parent


def kernel_at(rev: str, picks: Callable[[str], bool], binding: Callable[[dict[str, bytes]], str], prefix: str):
    """The extension `ferry_{prefix}_{short rev}` of commit `rev`'s csrc sources that `picks(file name)`
    and every header beside them, with `binding(their texts by file name)` as its module, built with
    this build's flags."""
    from torch.utils.cpp_extension import load

    from ferry.kernels.cpu import _checkout_key, _isa_flags

    git = dict(cwd=ROOT, check=True, capture_output=True)
    with tempfile.TemporaryDirectory(prefix=f"ferry-{prefix}-") as tmp:  # the build reads them, then they go
        work = Path(tmp)
        listed = subprocess.run(["git", "ls-tree", "--name-only", rev, CSRC + "/"], text=True, **git).stdout.split()
        texts = {}
        for path in listed:
            file = Path(path).name
            if picks(file) or file.endswith(".h"):
                texts[file] = subprocess.run(["git", "show", f"{rev}:{path}"], **git).stdout
                (work / file).write_bytes(texts[file])
        (work / "binding.cpp").write_text(binding(texts))
        sources = [str(work / f) for f in texts if f.endswith(".cpp")] + [str(work / "binding.cpp")]
        short = subprocess.run(["git", "rev-parse", "--short", rev], text=True, **git).stdout.strip()
        name = f"ferry_{prefix}_{short}_{_checkout_key()}"  # this CPU's and torch's, as ferry's own build
        flags = ["-O3", *_isa_flags()[1], "-fopenmp", "-ffast-math"]  # as ferry/kernels/cpu.py builds it
        return load(name=name, sources=sources, extra_cflags=flags, extra_ldflags=["-fopenmp"])
