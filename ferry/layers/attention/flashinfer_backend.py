"""FlashInfer's paged kernels (when the `flashinfer` package imports, on CUDA).

New K/V are stored with our Triton store kernel; FlashInfer's batch decode and batch
prefill wrappers are planned once per step (their page tables are CSR: indptr +
indices + last-page lengths, built here from the step's block tables) and run per layer
on the same [num_blocks, block_size, kv_heads, head_dim] (NHD) caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferry.layers.attention.metadata import AttentionMetadata


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a build that fails to load its libraries
        return False
    return True


@dataclass
class FlashInferState:
    decode: Any | None
    prefill: Any | None


def _csr(tables: list[np.ndarray], lens: list[int], block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    counts = [-(-n // block_size) for n in lens]
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    indptr[1:] = np.cumsum(counts)
    indices = np.concatenate([t[:c] for t, c in zip(tables, counts)]).astype(np.int32)
    last = np.array([n - (c - 1) * block_size for n, c in zip(lens, counts)], dtype=np.int32)
    return indptr, indices, last


class FlashInferAttentionBackend:
    name = "flashinfer"

    def __init__(self, device, num_heads: int, num_kv_heads: int, head_dim: int, dtype, cache_dtype, scale) -> None:
        import flashinfer

        from ferry.kernels import triton_attention

        self.store = triton_attention.store_kv
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.dtype, self.cache_dtype, self.scale, self.device = dtype, cache_dtype, scale, device
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=num_heads // num_kv_heads >= 4
        )
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    @staticmethod
    def _host(a: np.ndarray) -> torch.Tensor:
        """plan() copies its page tables to the device itself; host tensors avoid a round trip."""
        return torch.from_numpy(a)

    def prepare(self, meta: AttentionMetadata) -> None:
        h, kvh, d = self.shape
        bs = meta.block_size
        decode = prefill = None
        if meta.num_decodes:
            indptr, indices, last = _csr(meta.decode_blocks_host, meta.decode_seq_lens_host.tolist(), bs)
            self.decode_wrapper.plan(self._host(indptr), self._host(indices), self._host(last), h, kvh, d, bs,
                                     q_data_type=self.dtype, kv_data_type=self.cache_dtype,
                                     sm_scale=self.scale)  # fmt: skip
            decode = self.decode_wrapper
        if meta.prefills:
            lens = [p.context_len for p in meta.prefills]
            indptr, indices, last = _csr([p.block_ids for p in meta.prefills], lens, bs)
            qo = np.zeros(len(lens) + 1, dtype=np.int32)
            qo[1:] = np.cumsum([p.length for p in meta.prefills])
            self.prefill_wrapper.plan(self._host(qo), self._host(indptr), self._host(indices), self._host(last),
                                      h, kvh, d, bs, causal=True, sm_scale=self.scale,
                                      q_data_type=self.dtype, kv_data_type=self.cache_dtype)  # fmt: skip
            prefill = self.prefill_wrapper
        meta.state = FlashInferState(decode, prefill)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if meta.state.decode is not None:
            out[:nd] = meta.state.decode.run(q[:nd].contiguous(), (k_cache, v_cache))
        if meta.state.prefill is not None:
            out[nd:] = meta.state.prefill.run(q[nd:].contiguous(), (k_cache, v_cache))
        return out
