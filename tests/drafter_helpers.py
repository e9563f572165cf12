"""Helpers of tests/test_drafter.py: tiny draft models with their references, an engine
simulator that feeds propose() round after round, and KV / state snapshots."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from specdraft.drafter import Drafter
from specdraft.models.tiny import (
    eagle_config,
    random_causal_lm,
    random_eagle3_weights,
    random_eagle_weights,
    random_weights,
    tiny_config,
)
from specdraft.sampling import SamplingParams, filtered_probs
from tests.model_helpers import RefEagle

KINDS = ("llama", "eagle", "eagle3", "eagle_vocab")
# eagle_vocab: the EAGLE-1 head after reduce_vocab (80 of the 128 target ids, d2t)
MAPPED = ("eagle3", "eagle_vocab")  # kinds that propose from a draft vocabulary


def tiny(**kw):
    base = dict(
        num_layers=1,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=256,
    )
    return tiny_config(**{**base, **kw})


@dataclass
class DraftSetup:
    """A tiny draft of one kind and a float reference: ref_greedy(context, hiddens,
    steps) -> (tokens, logits per step)."""

    kind: str
    model: torch.nn.Module
    cfg: object
    weights: dict
    target: object = None

    @property
    def hidden_in(self) -> int:
        if self.kind == "llama":
            return 0
        return self.model.fc.in_features if self.kind == "eagle3" else self.cfg.hidden_size

    @property
    def keep(self) -> torch.Tensor:
        """eagle_vocab: the target ids of the draft vocabulary, ascending."""
        return self.model.draft_to_target(torch.arange(self.model.draft_vocab_size))

    @property
    def shift(self) -> int:
        return 0 if self.kind == "llama" else 1

    def ref(self):
        """A fresh float64 reference of the EAGLE head (None for the Llama draft)."""
        if self.kind in ("eagle", "eagle_vocab"):
            t = self.target
            head = t.lm_head.weight
            if self.kind == "eagle_vocab":  # logits over the draft vocabulary
                head = head[self.keep]
            return RefEagle(self.weights, self.cfg, t.embed_tokens.weight, head, eagle3=False)
        if self.kind == "eagle3":
            w = self.weights
            return RefEagle(w, self.cfg, w["embed_tokens.weight"], w["lm_head.weight"], eagle3=True)
        return None

    def to_target(self, tok: int) -> int:
        return int(self.model.draft_to_target(torch.tensor(tok))) if self.kind in MAPPED else tok

    @torch.no_grad()
    def ref_logits(self, tokens: list[int], hiddens: torch.Tensor | None, drafts: list[int]):
        """Reference logits (float64) of the draft at each of len(drafts) + 1 steps: after
        the committed context (tokens, and for EAGLE the target states hiddens[p] at each
        position p < len(tokens)), then after each token of `drafts` (target ids)."""
        if self.kind == "llama":
            out = self.model_hf(torch.tensor([tokens + drafts]))
            return out.logits[0, len(tokens) - 1 :].double()
        ref = self.ref()
        n = len(tokens)
        pos = torch.arange(n - 1)
        h, logits = ref(0, torch.tensor(tokens[1:]), hiddens[: n - 1], pos)
        out = [logits]
        for i, t in enumerate(drafts):
            h, logits = ref(0, torch.tensor([t]), h[-1:], torch.tensor([n - 1 + i]))
            out.append(logits)
        return torch.stack(out)

    def ref_greedy(self, tokens, hiddens, steps: int) -> list[int]:
        drafts: list[int] = []
        for _ in range(steps):
            logits = self.ref_logits(tokens, hiddens, drafts)[-1]
            drafts.append(self.to_target(int(logits.argmax())))
        return drafts


def make_setup(kind: str, seed: int = 0) -> DraftSetup:
    import transformers

    if kind == "llama":
        cfg = tiny()
        model = random_causal_lm(cfg, seed=seed)
        w = random_weights(cfg, seed=seed)
        s = DraftSetup(kind, model, cfg, w)
        hf = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**cfg.to_hf()))
        hf.load_state_dict(w, strict=False)
        s.model_hf = hf.double().eval()
        return s
    from specdraft.loader import Checkpoint, load_eagle3_head, load_eagle_head

    tcfg = tiny()
    if kind in ("eagle", "eagle_vocab"):
        target = random_causal_lm(tcfg, seed=seed + 100)
        cfg = eagle_config(tcfg)
        w = random_eagle_weights(cfg, seed=seed)
        model = load_eagle_head(Checkpoint.from_tensors(cfg.to_hf(), w), target=target)
        if kind == "eagle_vocab":
            g = torch.Generator().manual_seed(seed + 7)
            model.reduce_vocab(torch.randperm(tcfg.vocab_size, generator=g)[:80])
        return DraftSetup(kind, model, cfg, w, target)
    cfg = eagle_config(tcfg, draft_vocab_size=80, target_hidden_size=24)
    w = random_eagle3_weights(cfg, seed=seed)
    model = load_eagle3_head(Checkpoint.from_tensors(cfg.to_hf(["LlamaForCausalLMEagle3"]), w))
    return DraftSetup(kind, model, cfg, w)


@dataclass
class Seq:
    """One request as the engine sees it: committed tokens and (EAGLE) the target's
    state at every committed position."""

    tokens: list[int]
    hiddens: torch.Tensor | None
    verified: list[int] = field(default_factory=list)  # the block of the next round
    k: int = 0


class EngineSim:
    """Plays the engine around a Drafter: random prompts, verified blocks with random
    accepted counts (tokens drawn at random, standing for the target's), joins and
    leaves. Keeps the committed truth the tests compare with."""

    def __init__(self, setup: DraftSetup, drafter: Drafter, seed: int = 0):
        self.s, self.d = setup, drafter
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.seqs: dict = {}
        self._next = 0

    def _hid(self, n: int) -> torch.Tensor | None:
        if self.s.kind == "llama":
            return None
        return torch.randn(n, self.s.hidden_in, generator=self.gen).to(self.d.dtype)

    def join(self, n: int | None = None, params=None, k=None):
        rid = f"r{self._next}"
        self._next += 1
        n = n or self.rng.randint(2, 9)
        v = self.d.vocab_size
        toks = [self.rng.randrange(v) for _ in range(n)]
        hid = self._hid(n)
        dev = None if hid is None else hid.to(self.d.device)
        self.d.add_request(rid, toks, params, k, target_hidden=dev)
        first = self.rng.randrange(v)  # the target's first sampled token
        self.seqs[rid] = Seq(toks, hid, [first])
        return rid

    def leave(self, rid) -> None:
        self.d.remove_request(rid)
        del self.seqs[rid]

    def inputs(self, rids, width: int):
        """verified [B, width] (rows past a are junk), num_accepted [B], target_hidden,
        on the drafter's device."""
        ver, acc, hid = self._inputs(rids, width)
        dev = self.d.device
        return ver.to(dev), acc.to(dev), None if hid is None else hid.to(dev, self.d.dtype)

    def _inputs(self, rids, width: int):
        b = len(rids)
        ver = torch.randint(0, self.d.vocab_size, (b, width), generator=self.gen)
        acc = torch.zeros(b, dtype=torch.int64)
        hid = (
            None
            if self.s.kind == "llama"
            else torch.randn(b, width, self.s.hidden_in, generator=self.gen)
        )
        for i, r in enumerate(rids):
            q = self.seqs[r]
            a = len(q.verified) - 1
            ver[i, : a + 1] = torch.tensor(q.verified)
            acc[i] = a
            if hid is not None:
                m = len(q.tokens)
                hid[i, : a + 1] = torch.cat([q.hiddens[m - 1 : m], self._new_hidden(q, a)])[: a + 1]
        return ver, acc, hid

    def _new_hidden(self, q: Seq, a: int) -> torch.Tensor:
        """The target's states at the positions of verified rows 0 .. a - 1 (made once)."""
        if not hasattr(q, "pending_h") or q.pending_h.shape[0] != a + 1:
            q.pending_h = self._hid(a + 1)
        return q.pending_h[:a]

    def commit(self, rids) -> None:
        """Append each request's verified block to its committed tokens, then draw the
        next round's block: a random accepted count and random tokens."""
        for r in rids:
            q = self.seqs[r]
            q.tokens = q.tokens + q.verified
            if q.hiddens is not None:
                q.hiddens = torch.cat([q.hiddens, q.pending_h])
                del q.pending_h
            na = self.rng.randint(0, self.d.width - 1)
            q.verified = [self.rng.randrange(self.d.vocab_size) for _ in range(na + 1)]

    def context(self, rid):
        """(tokens, hiddens) the draft has seen once the round over rid has run."""
        q = self.seqs[rid]
        toks = q.tokens + q.verified
        hid = None
        if q.hiddens is not None:
            hid = torch.cat([q.hiddens, q.pending_h[:-1]])
        return toks, hid


def kv_rows(drafter: Drafter, rid, length: int) -> torch.Tensor:
    """K and V of positions [0, length) of request rid: [layers, 2, length, H, D]."""
    blocks = torch.tensor(drafter.tables.blocks_of(rid))
    data = drafter.cache.data[:, :, blocks]  # [L, 2, nb, bs, H, D]
    return data.flatten(2, 3)[:, :, :length]


@torch.no_grad()
def fresh_kv(setup: DraftSetup, tokens: list[int], hiddens, length: int) -> torch.Tensor:
    """K/V of a from-scratch prefill of the committed context in a new cache."""
    from tests.model_helpers import PagedRunner

    runner = PagedRunner(setup.cfg, "cpu", max_num_reqs=1, max_num_tokens=256, max_model_len=256)
    ids = tokens[setup.shift : setup.shift + length]
    meta = runner.step([(0, ids)])
    if setup.kind == "llama":
        setup.model(meta.input_ids, meta, runner.cache)
    else:
        setup.model(meta.input_ids, hiddens[:length], meta, runner.cache)
    blocks = torch.tensor(runner.tables.blocks_of(0))
    return runner.cache.data[:, :, blocks].flatten(2, 3)[:, :, :length]


def snapshot(d: Drafter) -> dict:
    """Everything a refused call must leave unchanged."""
    return {
        "host_rows": d.tables.host_rows.copy(),
        "free": d.tables.num_free_blocks,
        "n": len(d.tables),
        "lower": d.lengths.lower.copy(),
        "upper": d.lengths.upper.copy(),
        "base": d.buffers.base.clone(),
        "counters": d.buffers.counters.clone(),
        "cache": d.cache.data.clone(),
        "slot_k": d._slot_k.copy(),
        "rounds": d.rounds,
    }


def same_state(a: dict, b: dict) -> bool:
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():  # bit patterns: uninitialised cache rows may be NaN
                x, y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
            if not torch.equal(x, y):
                return False
        elif hasattr(x, "shape"):
            if not (x == y).all():
                return False
        elif x != y:
            return False
    return True


# ---- fixtures shared by the drafter tests ---------------------------------------------


@pytest.fixture(scope="module", params=KINDS)
def setup(request):
    return make_setup(request.param)


@pytest.fixture
def torch_layers(monkeypatch):
    """Model layers on their PyTorch path (fast on the CPU), the round's own kernels
    still through Triton (the interpreter): for the many-round tests."""
    from specdraft import draft_loop as loop_module
    from specdraft.kernels.draft_round import DraftRoundKernels
    from specdraft.ops import use_backend

    monkeypatch.setattr(loop_module, "draft_round_ops", lambda b, **kw: DraftRoundKernels(b, **kw))
    with use_backend("torch"):
        yield


def drafter(setup, **kw) -> Drafter:
    base = dict(max_num_reqs=4, k_max_options=(1, 3), max_model_len=160, max_prefill_tokens=16)
    return Drafter(setup.model, **{**base, **kw})


# ---- the draw distribution ------------------------------------------------------------


def chi_limit(df: int) -> float:
    return df + 10 * (2 * df) ** 0.5


def chi_square(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic with bins of expected count < 5 merged into one."""
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def draw_counts(
    rows: int,
    rounds: int,
    params: SamplingParams,
    *,
    k_max: int = 2,
    device="cpu",
    refresh: int = 200,
    **kw,
):
    """A Llama draft whose attention output is zeroed, so that each step's distribution
    depends on its input token only; `rows` requests with the same context and their own
    seeds, fed the same verified token every round (every `refresh` rounds they are
    replaced by new ones with new seeds, to stay inside the rotary table). Returns per
    position the observed counts and the expected counts (the sum of the filtered
    distributions the draws came from), the distribution after each token [V, V], and
    the drafter."""
    from dataclasses import replace

    s = make_setup("llama")
    model = s.model.to(device)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
    d = Drafter(model, max_num_reqs=rows, k_max_options=(k_max,), max_model_len=refresh + 16, **kw)
    v = d.vocab_size
    # the distribution after each token, from the model itself (attention contributes 0)
    with torch.no_grad():
        from tests.model_helpers import PagedRunner

        runner = PagedRunner(s.cfg, device, max_num_reqs=v, max_num_tokens=v, max_model_len=4)
        meta = runner.step([(t, [t]) for t in range(v)])
        _, logits = model(meta.input_ids, meta, runner.cache)
        dist = filtered_probs(logits.float(), params).double().cpu().numpy()
    counts = np.zeros((k_max, v))
    expected = np.zeros((k_max, v))
    ids = list(range(rows))
    ver = torch.full((rows, 1), 9, dtype=torch.int64, device=device)
    acc = torch.zeros(rows, dtype=torch.int64, device=device)
    for n in range(rounds):
        if n % refresh == 0:
            for i in ids:
                if i in d:
                    d.remove_request(i)
                d.add_request(i, [5, 6, 7], replace(params, seed=1000 + i + rows * n))
        toks = d.propose(ids, ver, acc).tokens.cpu().numpy()
        prev = np.full(rows, 9)
        for j in range(k_max):
            np.add.at(counts[j], toks[:, j], 1)
            expected[j] += dist[prev].sum(0)
            prev = toks[:, j]
    return counts, expected, dist, d
