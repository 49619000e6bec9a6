"""FlashInfer's paged kernels (when the `flashinfer` package imports, on CUDA).

New K/V are stored with our Triton store kernel; FlashInfer's batch decode and batch
prefill wrappers are planned once per step and kind of layer (their page tables are CSR:
indptr + indices + last-page lengths, built here from the step's block tables; a plan also
fixes the sliding window, soft cap and softmax scale) and run per layer on the same
[num_blocks, block_size, kv_heads, head_dim] (NHD) caches. Untested here: no GPU, and the
package is not installed on the CPU machines.
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
    decode_tables: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # CSR page table of the decode rows
    prefill_tables: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None  # qo indptr + CSR
    # (window, softcap, scale) -> the decode and prefill wrappers planned for it in this step
    planned: dict[tuple, tuple[Any, Any]]


def _csr(tables: list[np.ndarray], lens: list[int], block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    counts = [-(-n // block_size) for n in lens]
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    indptr[1:] = np.cumsum(counts)
    indices = np.concatenate([t[:c] for t, c in zip(tables, counts)]).astype(np.int32)
    last = np.array([n - (c - 1) * block_size for n, c in zip(lens, counts)], dtype=np.int32)
    return indptr, indices, last


class FlashInferAttentionBackend:
    """A plan fixes the window, the soft cap and the softmax scale, so each kind of layer (Gemma's
    local and global ones) has its own pair of wrappers, planned on its first layer of a step."""

    name = "flashinfer"

    def __init__(self, device, num_heads: int, num_kv_heads: int, head_dim: int, dtype, cache_dtype) -> None:
        import flashinfer

        from ferry.kernels import triton_attention

        self.flashinfer = flashinfer
        self.store = triton_attention.store_kv
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.dtype, self.cache_dtype, self.device = dtype, cache_dtype, device
        self._wrappers: dict[tuple, tuple[Any, Any]] = {}

    def _wrappers_for(self, key: tuple) -> tuple[Any, Any]:
        """A decode and a prefill wrapper for one kind of layer, with their own workspace (a plan lives
        in its workspace, and plans of two kinds are alive in one step)."""
        if key not in self._wrappers:
            h, kvh, _ = self.shape
            workspace = torch.empty(128 << 20, dtype=torch.uint8, device=self.device)
            decode = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                        use_tensor_cores=h // kvh >= 4)  # fmt: skip
            self._wrappers[key] = (decode, self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD"))
        return self._wrappers[key]

    @staticmethod
    def _host(a: np.ndarray) -> torch.Tensor:
        """plan() copies its page tables to the device itself; host tensors avoid a round trip."""
        return torch.from_numpy(a)

    def prepare(self, meta: AttentionMetadata) -> None:
        bs = meta.block_size
        decode = prefill = None
        if meta.num_decodes:
            decode = _csr(meta.decode_blocks_host, meta.decode_seq_lens_host.tolist(), bs)
        if meta.prefills:
            lens = [p.context_len for p in meta.prefills]
            qo = np.zeros(len(lens) + 1, dtype=np.int32)
            qo[1:] = np.cumsum([p.length for p in meta.prefills])
            prefill = (qo, *_csr([p.block_ids for p in meta.prefills], lens, bs))
        meta.state = FlashInferState(decode, prefill, {})

    def _planned(self, meta: AttentionMetadata, window: int | None, softcap: float | None, scale: float):
        state: FlashInferState = meta.state
        key = (window, softcap, scale)
        if key in state.planned:
            return state.planned[key]
        h, kvh, d = self.shape
        bs = meta.block_size
        # FlashInfer's window_left: keys i - window_left .. i, i.e. HF's window minus one.
        common = dict(q_data_type=self.dtype, kv_data_type=self.cache_dtype, sm_scale=scale,
                      window_left=-1 if window is None else window - 1, logits_soft_cap=softcap)  # fmt: skip
        decode_wrapper, prefill_wrapper = self._wrappers_for(key)
        decode = prefill = None
        if state.decode_tables is not None:
            indptr, indices, last = state.decode_tables
            decode_wrapper.plan(self._host(indptr), self._host(indices), self._host(last), h, kvh, d, bs, **common)
            decode = decode_wrapper
        if state.prefill_tables is not None:
            qo, indptr, indices, last = state.prefill_tables
            prefill_wrapper.plan(self._host(qo), self._host(indptr), self._host(indices), self._host(last),
                                 h, kvh, d, bs, causal=True, **common)  # fmt: skip
            prefill = prefill_wrapper
        state.planned[key] = (decode, prefill)
        return decode, prefill

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        decode, prefill = self._planned(meta, window, softcap, scale)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if decode is not None:
            out[:nd] = decode.run(q[:nd].contiguous(), (k_cache, v_cache))
        if prefill is not None:
            out[nd:] = prefill.run(q[nd:].contiguous(), (k_cache, v_cache))
        return out
