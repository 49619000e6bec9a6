"""Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one compressed row per token.

Each token's K and V come from a shared latent c (kv_lora_rank wide, RMS-normalised) through
kv_b_proj, plus one rotary key k_pe (qk_rope_head_dim) shared by all heads. The paged cache stores
[c, k_pe] (576 values for DeepSeek-V2/V3: 1,152 bytes in bf16 a token and layer, against 32,768 for
their 128 heads' expanded K/V) in one tensor, as MQA with one KV "head".

- Decode rows use the absorbed form: q_nope is projected into the latent space through each head's
  W_UK (kv_b_proj's key rows), so every head attends to the cached rows directly: q = [q_nope W_UK,
  q_pe] against K = [c, k_pe], V = c, then each head's output goes back through its W_UV. No K/V is
  ever expanded; a step reads 576 values per cached token, whatever the head count.
- Prefill chunks use the expanded form: the chunk's context rows (its cached prefix, then itself)
  go through kv_b_proj into per-head K/V of qk_nope + qk_rope and v_head_dim, and attend as
  ordinary multi-head attention, which costs fewer FLOPs when many queries share the context. V is
  zero-padded to K's width (192 for DeepSeek) and a chunk over a cached prefix is causal aligned
  bottom-right rather than a boolean mask, so SDPA takes its flash kernels (as vLLM pads V for
  FlashAttention): on this CPU 2.2x faster at 1,024 tokens than the math path unequal widths get.
  Where the backend has a paged prefill kernel for such K/V (Triton; the C++ one for fp32 on the
  CPU), all of a step's chunks go at once instead (layers/attention/contexts.py): one gather, one
  kv_b_proj GEMM and one kernel call per layer, not ~20 ops per chunk and layer.

Under tensor parallelism the heads are sharded (q and kv_b_proj by output rows, o_proj by input
columns); the latent is computed and cached whole on every rank (it has no head dimension).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferry.distributed.parallel_state import TensorParallel
from ferry.kv_quant import dequantize_rows, is_quantized
from ferry.layers.attention import AttentionMetadata
from ferry.layers.attention.contexts import step_context_groups
from ferry.layers.linear import Linear
from ferry.layers.norm import RMSNorm
from ferry.layers.rotary import RotaryEmbedding, attention_scale


class MLAAttention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, tp: TensorParallel) -> None:
        """cfg: the model's ModelConfig (its MLA fields; models/ sits above this package)."""
        super().__init__()
        # SDPA's lower-right causal bias keeps its flash kernels (a boolean mask takes the math path).
        # Imported here, by MLA models only: torch.nn.attention.bias imports torch._dynamo, ~3 s of a
        # start that no other model needs.
        from torch.nn.attention.bias import causal_lower_right

        self._causal_lower_right = causal_lower_right
        self.tp = tp
        self.num_heads = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = 1  # the cache's one shared row per token
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        h = cfg.hidden_size
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * qk, bias=False)
        else:
            self.q_proj = Linear(h, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        # A plain matrix, never packed: the absorbed decode reads it per head (W_UK, W_UV).
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=cfg.attention_bias)
        self.rotary = rotary
        self.scale = attention_scale(qk, cfg.rope_scaling)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        T, H = x.shape[0], self.num_heads
        q = self._queries(x).view(T, H, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :].contiguous()
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_pe = k_pe.unsqueeze(1).contiguous()  # [T, 1, rope]
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        rows = torch.cat([latent, k_pe.squeeze(1)], dim=-1)  # [T, rank + rope]: what the cache keeps
        cache = kv_cache[0]  # the same tensor as kv_cache[1]: MLA caches no separate V
        meta.backend.store_latent(cache, meta.slot_mapping, rows)
        out = torch.empty(T, H, self.v_dim, dtype=x.dtype, device=x.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._absorbed_decode(q_nope[:nd], q_pe[:nd], cache, meta)
        self._expanded_prefill(q_nope, q_pe, rows, cache, meta, out)
        return self.tp.all_reduce(self.o_proj(out.reshape(T, H * self.v_dim)))

    def _attend_contexts(self, q: torch.Tensor, cache: torch.Tensor, group, meta, o: torch.Tensor) -> None:
        """A group of chunks (layers/attention/contexts.py): their contexts' rows gathered from the cache
        in one index_select, expanded by one kv_b_proj GEMM into K and V (padded to K's width), and
        attended in one kernel call into the chunks' rows of o [T, H, qk]. Every row is read back from
        the cache, the chunk's own too (with a bf16 or quantized cache, what decode will read)."""
        H, qk = self.num_heads, self.nope + self.rope
        ctx = cache.view(-1, cache.shape[-1]).index_select(0, group.slots)
        ctx = dequantize_rows(ctx, q.dtype) if is_quantized(cache.dtype) else ctx.to(q.dtype)
        kv = F.linear(ctx[:, : self.rank], self.kv_b_proj.weight).view(-1, H, self.nope + self.v_dim)
        k = torch.cat([kv[..., : self.nope], ctx[:, None, self.rank :].expand(-1, H, -1)], dim=-1)
        v = F.pad(kv[..., self.nope :], (0, qk - self.v_dim))
        del kv, ctx  # K and V are what the kernel reads: hold no more than them
        blocks = (-1, meta.block_size, H, qk)
        meta.backend.attend_contexts(q, k.view(blocks), v.view(blocks), group, meta, self.scale, o)

    def _head_matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, rank], W_UV [H, v, rank]): kv_b_proj's rows per head."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _absorbed_decode(self, q_nope, q_pe, cache, meta) -> torch.Tensor:
        w_uk, w_uv = self._head_matrices()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, rank]
        q = torch.cat([q_latent, q_pe], dim=-1)
        o_latent = meta.backend.latent_decode(q, cache, meta, self.scale, self.rank)  # [B, H, rank]
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]

    def _expanded_prefill(self, q_nope, q_pe, rows, cache, meta, out: torch.Tensor) -> None:
        """The prefill chunks as multi-head attention over their contexts' expanded K/V, into their rows of
        out: all at once where the backend attends over laid-out contexts (`attend_contexts`), else
        chunk by chunk through SDPA."""
        if not meta.prefills:
            return
        if meta.backend.attends_contexts(q_nope.dtype) and self.v_dim <= self.nope + self.rope:
            q = torch.cat([q_nope, q_pe], dim=-1)
            o = torch.empty_like(q)  # every group writes its chunks' rows
            groups = step_context_groups(meta, q.device)
            for group in groups:
                self._attend_contexts(q, cache, group, meta, o)
            begin, end = groups[0].rows[0], groups[-1].rows[1]  # the chunks lie back to back (step_plan)
            out[begin:end] = o[begin:end, :, : self.v_dim]
            return
        H = q_nope.shape[1]
        flat = cache.view(-1, cache.shape[-1])
        quantized = is_quantized(cache.dtype)
        for chunk in meta.backend.view(meta).chunks:
            s, n = chunk.start, chunk.length
            if chunk.context_slots is not None:
                ctx = flat.index_select(0, chunk.context_slots)
            elif quantized:  # attend to the stored rows, as decode will
                ctx = flat.index_select(0, meta.slot_mapping[s : s + n])
            else:
                ctx = rows[s : s + n]
            if quantized:
                ctx = dequantize_rows(ctx, q_nope.dtype)
            ctx = ctx.to(q_nope.dtype)
            kv = F.linear(ctx[:, : self.rank], self.kv_b_proj.weight).view(-1, H, self.nope + self.v_dim)
            k_pe = ctx[:, None, self.rank :].expand(-1, H, -1)
            k = torch.cat([kv[..., : self.nope], k_pe], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, H, L, qk]
            v = kv[..., self.nope :].transpose(0, 1).unsqueeze(0)
            if self.v_dim < k.shape[-1]:  # V padded to K's width: SDPA's flash kernels want one head size
                v = F.pad(v, (0, k.shape[-1] - self.v_dim))
            q = torch.cat([q_nope[s : s + n], q_pe[s : s + n]], dim=-1).transpose(0, 1).unsqueeze(0)
            if chunk.context_slots is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            else:  # the chunk's queries are the context's last n positions: causal, aligned bottom-right
                mask = self._causal_lower_right(n, k.shape[2])
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            out[s : s + n] = o.squeeze(0).transpose(0, 1)[..., : self.v_dim]
