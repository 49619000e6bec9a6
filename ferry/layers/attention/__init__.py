"""Paged attention behind one interface, with the backend chosen per engine.

- `torch`: the reference (SDPA, plus the C++ decode kernel on the CPU); the test oracle.
- `triton`: our store / split-KV decode / varlen prefill kernels (GPU; on the CPU
  under TRITON_INTERPRET=1 for tests).
- `flashinfer`: FlashInfer's paged kernels, when the package imports (CUDA only).

`auto` picks flashinfer, else triton, on CUDA, and torch on the CPU.
"""

from __future__ import annotations

import torch

from ferry.kv_quant import is_quantized
from ferry.layers.attention.metadata import AttentionBackend, AttentionMetadata, PrefillHost, build_metadata
from ferry.layers.attention.torch_backend import TorchAttentionBackend, cpu_decode_kernel_usable

__all__ = [
    "one_prompt_metadata",
    "one_sequence_decode_metadata",
    "AttentionBackend",
    "AttentionMetadata",
    "PrefillHost",
    "build_metadata",
    "paged_attention",
    "select_attention_backend",
    "TorchAttentionBackend",
]


def one_prompt_metadata(
    num_tokens: int, device: torch.device, backend: AttentionBackend | None = None, block_size: int = 1
) -> tuple[AttentionMetadata, torch.Tensor]:
    """One prompt of `num_tokens` tokens laid out over blocks 0, 1, ... of `block_size` (token t in
    slot t) on `backend` (default: the reference backend), and its positions: a forward outside the
    engine (calibration, quality measurements, timing a layer) over a throwaway cache, by default
    of [num_tokens, 1, ...] tensors."""
    import numpy as np

    slots = np.arange(num_tokens, dtype=np.int64)
    table = np.arange(-(-num_tokens // block_size), dtype=np.int64)
    meta = build_metadata(slot_mapping=slots, block_size=block_size, decode_blocks=[], decode_seq_lens=slots[:0],
                          prefills=[PrefillHost(0, num_tokens, num_tokens, table)], device=device,
                          backend=backend or TorchAttentionBackend(device))  # fmt: skip
    return meta, torch.from_numpy(slots).to(device)


def one_sequence_decode_metadata(num_tokens: int, block_size: int, device: torch.device,
                                 backend: AttentionBackend) -> tuple[AttentionMetadata, torch.Tensor]:  # fmt: skip
    """The tokens of one sequence as `num_tokens` decode rows over blocks 0, 1, ... of `block_size`
    (token t in slot t; row t attends to tokens 0..t, its own K/V stored in the same layer, as a
    verify step lays out drafts) on `backend`, and their positions: a teacher-forced pass through
    the decode kernels, whose arithmetic can differ from the prompt path's (`ferry bench quality
    --decode-rows`)."""
    import numpy as np

    slots = np.arange(num_tokens, dtype=np.int64)
    table = np.arange(-(-num_tokens // block_size), dtype=np.int64)
    meta = build_metadata(slot_mapping=slots, block_size=block_size, decode_blocks=[table] * num_tokens,
                          decode_seq_lens=slots + 1, prefills=[], device=device,
                          backend=backend)  # fmt: skip
    return meta, torch.from_numpy(slots).to(device)


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """q: [T, H, D]; k, v: [T, KVH, D]. Stores k/v in the cache, returns [T, H, D]. `window`: this
    layer's sliding window (query i sees keys i - window < j <= i); `softcap`: its attention logits
    through softcap * tanh(logits / softcap) (Gemma 2). Every backend takes both."""
    return meta.backend.forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention_backend(name: str, device: torch.device, cache_dtype: torch.dtype = torch.bfloat16) -> str:
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        from ferry.layers.attention.flashinfer_backend import flashinfer_available

        # FlashInfer's kernels take 16-bit caches only (not fp32, not our scaled int8/fp8 rows).
        usable = cache_dtype in (torch.bfloat16, torch.float16)
        return "flashinfer" if usable and flashinfer_available() else "triton"
    if name == "flashinfer":
        from ferry.layers.attention.flashinfer_backend import flashinfer_available

        if device.type != "cuda" or not flashinfer_available():
            raise ValueError("--attention-backend flashinfer needs CUDA and the flashinfer package")
        if is_quantized(cache_dtype):
            raise ValueError(
                "--attention-backend flashinfer does not read int8/fp8 KV caches (per-row scales); use triton"
            )
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise ValueError("--attention-backend triton needs the triton package") from e
        import os

        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--attention-backend triton on the CPU runs only under TRITON_INTERPRET=1 (for tests)")
    return name


def select_attention_backend(
    name: str,
    device: torch.device,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    latent: bool = False,
) -> AttentionBackend:
    """The backend for this engine. `latent`: multi-head latent attention (`store_latent`,
    `latent_decode`), which the torch and Triton backends run (`auto`: Triton on CUDA)."""
    if latent:
        if name == "flashinfer":
            raise ValueError("--attention-backend flashinfer does not run multi-head latent attention; use triton")
        if name == "auto":
            name = "triton" if device.type == "cuda" and _triton_importable() else "torch"
        if name == "triton":
            resolve_attention_backend(name, device, cache_dtype)  # the package, and the interpreter on the CPU
            from ferry.kernels.triton_mla import head_blocks
            from ferry.layers.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend(device, head_blocks(num_heads))
        return TorchAttentionBackend(device)
    name = resolve_attention_backend(name, device, cache_dtype)
    if name == "triton":
        from ferry.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device, num_kv_heads)
    if name == "flashinfer":
        from ferry.layers.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(device, num_heads, num_kv_heads, head_dim, dtype, cache_dtype)
    use_kernel = cpu_decode_kernel_usable(device, cache_dtype) and dtype == torch.float32
    return TorchAttentionBackend(device, use_cpu_kernel=use_kernel)
