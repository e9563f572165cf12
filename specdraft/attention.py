"""The attention layer over the paged cache: store this step's K/V, then attend."""

from __future__ import annotations

import torch

from specdraft.kernels import paged_attention, store_kv

from .attn_metadata import AttentionMetadata


class PagedAttention(torch.nn.Module):
    """Stores K/V at the metadata's slots and runs paged attention. Metadata is passed
    explicitly to every call: there is no global context."""

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window, self.softcap = sliding_window, softcap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [num_tokens, Hq, D], k and v [num_tokens, Hkv, D] with num_tokens equal to
        meta.num_tokens; returns [num_tokens, Hq, D] (zeros on padded tokens)."""
        if q.shape[0] != meta.num_tokens:
            raise ValueError(f"q has {q.shape[0]} tokens, the metadata {meta.num_tokens}")
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            self.scale,
            out=out,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
        )
