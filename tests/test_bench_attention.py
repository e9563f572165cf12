"""bench/attention.py's FlashInfer peer, off the GPU: the block tables in FlashInfer's CSR
paging, the table's note when FlashInfer is missing, and the launches' arguments checked
by a stand-in module that computes what FlashInfer documents for them."""

from __future__ import annotations

import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from bench import attention as A
from tests.reference import paged_attention_ref


def test_paging_matches_the_block_table():
    g = torch.Generator().manual_seed(3)
    for context, ps in ((33, 16), (32, 16), (1, 16), (70, 8)):
        n = math.ceil(context / ps)
        table = torch.randperm(5 * n, generator=g)[: 3 * n].view(3, n).to(torch.int32)
        indptr, indices, last = A.flashinfer_paging(table, context, ps)
        assert indptr.tolist() == [0, n, 2 * n, 3 * n]
        assert indices.dtype == last.dtype == indptr.dtype == torch.int32
        for r in range(3):
            pages = indices[indptr[r] : indptr[r + 1]]
            assert torch.equal(pages, table[r])
            assert (len(pages) - 1) * ps + int(last[r]) == context
            assert 1 <= int(last[r]) <= ps


def test_paging_refuses_a_table_of_the_wrong_width():
    table = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="table has 3 pages a request, context 16 needs 1"):
        A.flashinfer_paging(table, 16, 16)


def test_note_says_when_flashinfer_is_missing(monkeypatch):
    monkeypatch.setattr(A, "flashinfer_available", lambda: False)
    assert A.flashinfer_note() == "FlashInfer: not importable here, so not measured."


def _csr_attention(q, k_cache, v_cache, qo_indptr, indptr, indices, last, ps, scale, causal):
    """What FlashInfer computes from its CSR arguments, in float64: request r's keys are
    its pages' tokens in order, the last page holding last[r]; causal queries sit at the
    end of the context (bottom-right)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    hq, hkv = q.shape[1], k_cache.shape[2]
    for r in range(len(indptr) - 1):
        pages = indices[indptr[r] : indptr[r + 1]].long()
        kv_len = (len(pages) - 1) * ps + int(last[r])
        k = k_cache[pages].reshape(-1, hkv, q.shape[2])[:kv_len].double()
        v = v_cache[pages].reshape(-1, hkv, q.shape[2])[:kv_len].double()
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        q0, q1 = int(qo_indptr[r]), int(qo_indptr[r + 1])
        for i in range(q0, q1):
            seen = kv_len - (q1 - i) + 1 if causal else kv_len
            s = torch.einsum("hd,thd->ht", q[i].double(), k[:seen]) * scale
            out[i] = torch.einsum("ht,thd->hd", s.softmax(-1), v[:seen])
    return out


class _Wrapper:
    def __init__(self, ws, layout, use_cuda_graph=False, **buffers):
        assert layout == "NHD" and use_cuda_graph and ws.numel() == A.FLASHINFER_WORKSPACE
        self.buffers = buffers

    def run(self, q, kv, out):
        k_cache, v_cache = kv
        p = self.planned
        res = _csr_attention(q, k_cache, v_cache, p["qo"], p["indptr"], p["indices"], p["last"],
                             p["ps"], p["sm_scale"], p["causal"])  # fmt: skip
        out.copy_(res)


class _Decode(_Wrapper):
    def plan(self, indptr, indices, last, hq, hkv, d, ps, **kw):
        assert (hq, hkv, d) == (A.HQ, A.HKV, A.HEAD_DIM) and kw["q_data_type"] == A.DTYPE
        assert indptr is self.buffers["paged_kv_indptr_buffer"]
        qo = torch.arange(len(indptr), dtype=torch.int32)
        self.planned = dict(qo=qo, indptr=indptr, indices=indices, last=last, ps=ps,
                            sm_scale=kw["sm_scale"], causal=False)  # fmt: skip


class _Prefill(_Wrapper):
    def plan(self, qo, indptr, indices, last, hq, hkv, d, ps, causal=False, **kw):
        assert (hq, hkv, d) == (A.HQ, A.HKV, A.HEAD_DIM) and kw["kv_data_type"] == A.DTYPE
        assert qo is self.buffers["qo_indptr_buf"]
        self.planned = dict(qo=qo, indptr=indptr, indices=indices, last=last, ps=ps,
                            sm_scale=kw["sm_scale"], causal=causal)  # fmt: skip


@pytest.mark.parametrize("q_len", [1, 4])
def test_launches_compute_our_attention_under_flashinfer_semantics(monkeypatch, q_len):
    """The stand-in computes what FlashInfer documents for the arguments the launches
    pass; the result must be the same attention as the float64 reference of our paged
    form (so the paging, the heads, the scale and the causal alignment are right)."""
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = _Decode
    fake.BatchPrefillWithPagedKVCacheWrapper = _Prefill
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(A, "DTYPE", torch.float32)
    A.set_geometry("smollm2")
    try:
        g = torch.Generator().manual_seed(q_len)
        shape = A.Shape("decode" if q_len == 1 else "verify", 3, 37, q_len)
        nb = math.ceil(shape.context / A.BLOCK_SIZE)
        k_cache = torch.randn(2 * 3 * nb, A.BLOCK_SIZE, A.HKV, A.HEAD_DIM, generator=g)
        v_cache = torch.randn(k_cache.shape, generator=g)
        tables = list(torch.randperm(2 * 3 * nb, generator=g).view(2, 3, nb).to(torch.int32))
        qs = [torch.randn(3 * q_len, A.HQ, A.HEAD_DIM, generator=g) for _ in tables]
        case = SimpleNamespace(
            shape=shape, k_cache=k_cache, v_cache=v_cache, tables=tables, qs=qs,
            outs=[torch.full_like(q, float("nan")) for q in qs],
            qsl=torch.arange(4, dtype=torch.int32) * q_len,
        )  # fmt: skip
        launches = A.flashinfer_launches(case)
        assert len(launches) == 2
        seq_lens = torch.full((3,), shape.context, dtype=torch.int32)
        for launch, q, out, table in zip(launches, qs, case.outs, tables):
            launch()
            ref = paged_attention_ref(q, k_cache, v_cache, case.qsl, seq_lens, table,
                                      A.HEAD_DIM**-0.5)  # fmt: skip
            assert (out.double() - ref).abs().max().item() < 1e-5
    finally:
        A.set_geometry("llama")
