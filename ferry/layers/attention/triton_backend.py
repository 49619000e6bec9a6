"""Our Triton kernels (ferry/kernels/triton_attention.py) behind the backend interface.

Per layer: one store launch for all new tokens, one split-KV decode launch (plus the
merge) for the decode rows, one varlen prefill launch for all chunks; the layer's sliding window
and soft-capping go to the kernels as constants. The decode
launch's shape depends on the batch size only, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.layers.attention.metadata import AttentionMetadata


@dataclass
class TritonState:
    num_splits: int


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a couple of splits, to exercise the merge


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, device: torch.device, num_kv_heads: int) -> None:
        from ferry.kernels import triton_attention

        self.kernels = triton_attention
        self.device = device
        self.num_kv_heads = num_kv_heads
        self.num_sms = _num_sms(device)

    def num_splits(self, batch: int) -> int:
        return self.kernels.decode_num_splits(batch, self.num_kv_heads, self.num_sms)

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.state = TritonState(num_splits=self.num_splits(meta.num_decodes))

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        kern = self.kernels
        kern.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            kern.paged_decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                              meta.state.num_splits, out=out[:nd], window=window, softcap=softcap)  # fmt: skip
        if meta.prefills:
            kern.paged_prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                               meta.prefill_seq_lens, meta.max_prefill_len, scale, out, window=window,
                               softcap=softcap)  # fmt: skip
        return out
