"""ferry's CPU paged decode attention (cpu_kernels().paged_decode_attention) by cache dtype, batch and
context: ms per layer and the K/V bytes it reads per second, best of --repeats. SmolLM2-135M's heads
(9 query heads, 3 kv heads, head size 64), 16-token blocks placed at random in the pool as a busy
engine leaves them. --layers distinct caches are attended in turn, so that with more K/V than the
last-level cache each layer's rows come from memory as in a decode step (--layers 1: hot in cache).
--order sequential places each sequence's blocks one after another (a fresh pool); --order reuse has
every sequence read the same 16 blocks, so rows come from L1/L2 and the time is the kernel's arithmetic.
The caches sit on transparent huge pages, as the engine's do (--pages 4k: torch's own allocations).
From the repo root:
    python3 scripts/cpu_attention_sweep.py [--batch 16 64] [--context 512 1024] [--layers 8]
    python3 scripts/cpu_attention_sweep.py --batch 64 --context 1024 --order random sequential reuse
    FERRY_CPU_ISA=avx2 python3 scripts/cpu_attention_sweep.py   # the AVX2 build of the same kernel
    python3 scripts/cpu_attention_sweep.py --against e142220 --rounds 3   # that commit's kernel beside this one
    python3 scripts/cpu_attention_sweep.py --against 5091070 HEAD   # two commits' kernels, each built alone
--against REV... builds each REV's paged_decode_attention_cpu.cpp as an extension of its own and times the
kernels alternately on the same caches (--rounds times each), so an old/new comparison shares the process
and the minute: this VM's speed drifts by 10-40% between runs. This tree's kernel is part of ferry's whole
extension, a different build from a commit's kernel alone (the bf16 kernel differed by -8..+3% between
the two builds of one commit): two committed revisions compare like with like. Revisions from before the
quantized block layout (kv_quant.py) get their int8 / fp8 caches as rows."""

from __future__ import annotations

import argparse
import itertools
import re
import time

import torch
from kernels_at_revision import kernel_at

from ferry.kernels.cpu import cpu_kernels
from ferry.kv_quant import KEYS, VALUES, blocks_of_rows, quantize_rows
from ferry.utils import lazy_zeros

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def cache(blocks: int, dtype: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    if dtype in ("int8", "fp8"):
        return quantize_rows(x, torch.int8 if dtype == "int8" else torch.float8_e4m3fn)
    return x.to(getattr(torch, dtype))


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` in one mapping of transparent huge pages, as the engine holds its KV cache
    (lazy_zeros, models/llama.py): on 4 KiB pages the kernels' reads from memory also pay TLB misses
    the engine does not (on the Xeon of BENCHMARKS.md's session 33, enough to hide a 10% change).
    A tensor given twice (a float cache is its own block layout) is copied once."""
    unique = list({id(t): t for t in tensors}.values())
    sizes = [-(-t.numel() * t.element_size() // 4096) * 4096 for t in unique]
    arena = lazy_zeros.zeros((max(sum(sizes), lazy_zeros.LAZY_MIN_BYTES),), torch.uint8, "cpu")
    copies, offset = {}, 0
    for t, size in zip(unique, sizes):
        n = t.numel() * t.element_size()
        copies[id(t)] = arena[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += size
    return [copies[id(t)] for t in tensors]


def block_table(order: str, batch: int, per_seq: int, gen: torch.Generator) -> torch.Tensor:
    blocks = batch * per_seq
    if order == "random":
        ids = torch.randperm(blocks, generator=gen)
    elif order == "sequential":
        ids = torch.arange(blocks)
    else:  # reuse: 16 blocks in all, read by every sequence
        ids = torch.arange(blocks) % 16
    return ids.view(batch, per_seq)


KERNEL = "paged_decode_attention_cpu.cpp"
# Revisions' kernels take an optional tree mask (tree verification), later ones an optional window
# skip too (OPTIONALS of them, none before either), all left out here.
BINDING = """#include <torch/extension.h>
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale
                                     OPTIONALS);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", [](torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor bt,
                                     torch::Tensor lens, double scale) {
    return paged_decode_attention(q, k, v, bt, lens, scale NULLOPTS);
  });
}
"""


def binding_for(texts: dict[str, bytes]) -> str:
    """A binding that declares the revision's signature and calls it with no tree and no window."""
    source = texts[KERNEL]
    # its return type: torch::Tensor until the sources took ATen's headers instead of <torch/extension.h>
    params = re.search(rb"(?:torch|at)::Tensor paged_decode_attention\((.*?)\)", source, re.S).group(1)
    n = params.count(b"c10::optional")
    declared = BINDING.replace("OPTIONALS", ", c10::optional<torch::Tensor>" * n)
    return declared.replace("NULLOPTS", ", c10::nullopt" * n)


def revision_lays_out_blocks(rev: str) -> bool:
    """Whether commit `rev`'s kernel reads a quantized cache's blocks laid out by head (kv_layout.h);
    before, it read rows."""
    import subprocess

    from kernels_at_revision import CSRC, ROOT

    listed = subprocess.run(["git", "ls-tree", "--name-only", rev, CSRC + "/"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()  # fmt: skip
    return any(p.endswith("/kv_layout.h") for p in listed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--order", nargs="+", default=["random"], choices=["random", "sequential", "reuse"])
    parser.add_argument("--against", nargs="+", default=[], metavar="REV",
                        help="also time these commits' kernels, alternately")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="times each kernel is timed (alternately)")
    parser.add_argument("--pages", choices=["huge", "4k"], default="huge",
                        help="caches on transparent huge pages, as the engine holds them, or torch's")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("no C++ compiler: ferry's CPU kernels are not built")
    builds = {"this tree": kernels}
    laid_out = {"this tree": True}  # whether a build reads a quantized cache's blocks laid out by head
    for rev in args.against:
        builds[rev] = kernel_at(rev, lambda f: f == KERNEL, binding_for, "attention")
        laid_out[rev] = revision_lays_out_blocks(rev)
    print(f"threads {args.threads}, {args.layers} layers' caches on {args.pages} pages, blocks of {BLOCK}")
    print("| blocks | cache | batch | context | kernel | ms per layer | x 30 layers | K/V GB/s |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    gen = torch.Generator().manual_seed(0)
    for batch in args.batch:
        for context in args.context:
            per_seq = -(-context // BLOCK)
            blocks = batch * per_seq
            lens = torch.full((batch,), context, dtype=torch.int64)
            q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
            for order, dtype in itertools.product(args.order, args.dtypes):
                table = block_table(order, batch, per_seq, gen)
                layers = [(cache(blocks, dtype, gen), cache(blocks, dtype, gen)) for _ in range(args.layers)]
                # the same caches as laid-out blocks (kv_quant.py), for the builds that read them so
                as_blocks = [(blocks_of_rows(k, KEYS), blocks_of_rows(v, VALUES)) for k, v in layers]
                if args.pages == "huge":
                    flat = on_huge_pages([t for kv in layers + as_blocks for t in kv])
                    pairs = list(zip(flat[0::2], flat[1::2]))
                    layers, as_blocks = pairs[: len(layers)], pairs[len(layers) :]
                k, v = layers[0]
                read = (k.numel() * k.element_size() + v.numel() * v.element_size()) * context / (per_seq * BLOCK)
                for _, (name, build) in itertools.product(range(args.rounds), builds.items()):
                    best = float("inf")
                    for _ in range(args.repeats + 1):
                        start = time.perf_counter()
                        for k, v in as_blocks if laid_out[name] else layers:
                            build.paged_decode_attention(q, k, v, table, lens, HEAD_DIM**-0.5)
                        best = min(best, (time.perf_counter() - start) / args.layers)
                    gbs = read / best / 1e9
                    print(f"| {order} | {dtype} | {batch} | {context} | {name} | {best * 1e3:.3f} | {best * 30e3:.1f} "
                          f"| {gbs:.1f} |", flush=True)  # fmt: skip
                del layers, as_blocks


if __name__ == "__main__":
    main()
