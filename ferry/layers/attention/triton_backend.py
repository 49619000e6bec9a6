"""Our Triton kernels (ferry/kernels/triton_attention.py) behind the backend interface.

Per layer: one store launch for all new tokens, one split-KV decode launch (plus the
merge) for the decode rows, one varlen prefill launch for all chunks; the layer's sliding window
and soft-capping go to the kernels as constants. The decode
launch's shape depends on the batch size only, so it can be captured in a CUDA graph.

Multi-head latent attention (layers/mla.py) stores its rows with the same store kernel (one cache)
and decodes in the absorbed form with kernels/triton_mla.py (`latent_decode`); its prefill chunks
attend in the expanded form over their contexts (`view`), as on the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.layers.attention.contexts import ContextGroup
from ferry.layers.attention.metadata import AttentionMetadata
from ferry.layers.attention.torch_backend import WindowView, prefill_chunks


@dataclass
class TritonState:
    num_splits: int
    prefill_view: WindowView | None = None  # MLA's expanded prefill: the chunks' contexts (`view`)
    context_groups: list[ContextGroup] | None = None  # the same, laid out for `attend_contexts`


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a couple of splits, to exercise the merge


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, device: torch.device, num_kv_heads: int) -> None:
        """`num_kv_heads`: the decode programs per request and split (KV heads; MLA's blocks of heads),
        which set how many splits fill the GPU."""
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

    def store_latent(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """MLA's rows [T, W] (latent then rotary key) into the one-head cache; slot -1 (a CUDA-graph
        padding row) writes nothing."""
        self.kernels.store_kv(rows.unsqueeze(1), None, cache, None, slots)

    def latent_decode(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      v_width: int) -> torch.Tensor:  # fmt: skip
        """MLA's absorbed decode (the torch backend's `latent_decode`, in kernels/triton_mla.py)."""
        from ferry.kernels.triton_mla import paged_latent_decode

        return paged_latent_decode(q, cache, meta.decode_block_tables, meta.decode_seq_lens, scale, v_width,
                                   meta.state.num_splits)  # fmt: skip

    def attends_contexts(self, dtype: torch.dtype) -> bool:
        return True

    def attend_contexts(self, q, k, v, group: ContextGroup, meta: AttentionMetadata, scale: float, out) -> None:
        """The group's chunks' rows of q [T, H, D] attend causally over K/V [blocks, block_size, H, D] laid
        out as `group` says, in one launch of the varlen prefill kernel (the layout's blocks as its
        tables), into the same rows of out [T, H, D]; its other rows are left as they are."""
        first, n = group.first, group.tables.shape[0]
        self.kernels.paged_prefill(q, k, v, group.tables, meta.prefill_query_start_loc[first : first + n + 1],
                                   meta.prefill_seq_lens[first : first + n], group.max_query_len, scale,
                                   out)  # fmt: skip

    def view(self, meta: AttentionMetadata, window: int | None = None) -> WindowView:
        """The prefill chunks' contexts for MLA's expanded prefill (built once per step)."""
        if window is not None:
            raise ValueError("multi-head latent attention has no sliding window")
        state: TritonState = meta.state
        if state.prefill_view is None:
            state.prefill_view = WindowView(chunks=prefill_chunks(meta, None, self.device))
        return state.prefill_view
