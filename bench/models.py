"""Draft-model decode-step benchmark (GPU only).

One decode step (one token per request, `--ctx` tokens already cached) of
  (a) a llama-68m-shaped draft (2 layers, hidden 768, 12 heads, FFN 3072, vocab 32000),
  (b) an EAGLE-1 head for a Llama-3-8B target (hidden 4096, 32/8 heads, FFN 14336,
      vocab 128256: fc 2h -> h, one decoder layer, the 128256 x 4096 lm_head),
at batch 1 and 64, bf16, random weights. specdraft runs eagerly (the issue's bar) and,
as an extra column, under CUDA-graph replay. Next to the times: the weight-read floor
(bytes of weights one step reads / the read-only bandwidth measured in the same run), the
same plus the K/V the step reads, and the same shapes in Hugging Face transformers
(eager, its contiguous DynamicCache) timed in the same run. For (b) the transformers
peer is an nn.Embedding + nn.Linear fc + a one-layer LlamaModel + an nn.Linear lm_head
(LlamaModel adds an input norm on layer 0 and a final norm that EAGLE-1 lacks: two
RMSNorms over the batch's rows, negligible here).

    python -m bench.models [--out results] [--ctx 256] [--batches 1,64] [--iters 50]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from bench.common import eager_us
from specdraft.loader import Checkpoint, load_eagle_head
from specdraft.models.tiny import (
    eagle_config,
    llama3_8b_config,
    llama_68m_config,
    random_causal_lm,
    random_eagle_weights,
    random_weights,
)
from tests.model_helpers import PagedRunner, hf_forward

CASES = ("llama-68m", "eagle-llama3-8b")
DEVICE = "cuda"


def weight_bytes(model: nn.Module, batch: int) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied
    embedding table, of which only `batch` rows are read."""
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    total = 0
    for p in model.parameters():  # shared / tied parameters are listed once
        if p is embed and not tied:
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def kv_bytes(cfg, batch: int, ctx: int) -> int:
    return batch * (ctx + 1) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


class HFEagle(nn.Module):
    """The EAGLE-1 head's shapes in transformers modules."""

    def __init__(self, cfg):
        super().__init__()
        import transformers

        h = cfg.hidden_size
        inner = transformers.AutoConfig.for_model(**{**cfg.to_hf(), "vocab_size": 8})
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.model = transformers.LlamaModel(inner)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)

    def forward(self, ids, hidden, cache=None):
        x = self.fc(torch.cat([self.embed(ids), hidden], dim=-1))
        out, cache = hf_forward(self.model, None, cache, inputs_embeds=x)
        return self.lm_head(out.last_hidden_state[:, -1]), cache


def build(case: str, ctx: int, *, hf: bool = True):
    """(config, our model, transformers model or None without hf) with random bf16
    weights on the GPU."""
    import transformers

    if case == "llama-68m":
        cfg = llama_68m_config()
        ours = random_causal_lm(cfg, seed=0, device=DEVICE, max_positions=ctx + 64)
    else:
        cfg = eagle_config(llama3_8b_config())
        w = random_eagle_weights(cfg, seed=0, with_embed=True, device=DEVICE)
        w["lm_head.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, device=DEVICE)
        ckpt = Checkpoint.from_tensors(cfg.to_hf(), w)
        ours = load_eagle_head(ckpt, device=DEVICE, max_positions=ctx + 64)
        del w, ckpt
    if not hf:
        return cfg, ours.eval(), None
    with torch.device(DEVICE):
        if case == "llama-68m":
            peer = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**cfg.to_hf()))
        else:
            peer = HFEagle(cfg)
    if case == "llama-68m":
        peer.load_state_dict(random_weights(cfg, seed=0, device=DEVICE))
    return cfg, ours.eval(), peer.to(torch.bfloat16).eval()


@torch.inference_mode()
def bench_case(case: str, batch: int, ctx: int, iters: int, read_bw: float, built) -> dict:
    from bench.common import time_graph_us

    cfg, ours, hf = built
    eagle = case != "llama-68m"
    runner = PagedRunner(
        cfg, DEVICE, max_num_reqs=batch, max_num_tokens=max(batch, 16), max_model_len=ctx + 64
    )
    for r in range(batch):  # ctx tokens "cached" (random K/V), then one decode token
        runner.tables.add_request(r, ctx + 1)
        runner.lens[r] = ctx
    tokens = torch.randint(0, cfg.vocab_size, (batch,))
    meta = runner.step([(r, [int(tokens[r])]) for r in range(batch)])
    hidden = torch.randn(batch, cfg.hidden_size, device=DEVICE, dtype=ours.dtype)
    if eagle:
        step = lambda: ours(meta.input_ids, hidden, meta, runner.cache)  # noqa: E731
    else:
        step = lambda: ours(meta.input_ids, meta, runner.cache)  # noqa: E731
    ours_us = eager_us(step, iters=iters)
    try:
        graph_us = time_graph_us([step])
    except Exception as e:  # a capture failure is a finding, not a crash of the table
        print(f"  {case} b{batch}: CUDA-graph capture failed: {e!r}", file=sys.stderr)
        graph_us = None

    # transformers: fill a contiguous cache with ctx tokens, then time one decode step
    ids = torch.randint(0, cfg.vocab_size, (batch, ctx), device=DEVICE)
    tok = tokens.view(batch, 1).to(DEVICE)
    if eagle:
        feats = torch.randn(batch, ctx, cfg.hidden_size, device=DEVICE, dtype=ours.dtype)
        _, cache = hf(ids, feats)
        hf_step = lambda: hf(tok, hidden.view(batch, 1, -1), cache)  # noqa: E731
    else:
        _, cache = hf_forward(hf, ids, logits_to_keep=1)
        hf_step = lambda: hf_forward(hf, tok, cache, logits_to_keep=1)  # noqa: E731
    hf_us = eager_us(hf_step, iters=iters, after=lambda: cache.crop(-1))

    wb = weight_bytes(ours, batch)
    kvb = kv_bytes(cfg, batch, ctx)
    floor_w = wb / (read_bw * 1e12) * 1e6
    floor_wkv = (wb + kvb) / (read_bw * 1e12) * 1e6
    return {
        "model": case,
        "batch": batch,
        "ctx": ctx,
        "ours_us": ours_us,
        "graph_us": graph_us,
        "weight_mb": wb / 1e6,
        "kv_mb": kvb / 1e6,
        "floor_w_us": floor_w,
        "floor_wkv_us": floor_wkv,
        "hf_us": hf_us,
        "hf_over_ours": hf_us / ours_us,
        "ours_over_floor": ours_us / floor_w,
        "graph_over_floor": graph_us / floor_w if graph_us else None,
        "hf_attn": (hf.config if hasattr(hf, "config") else hf.model.config)._attn_implementation,
    }


COLUMNS = [
    ("model", "model"),
    ("batch", "batch"),
    ("ctx", "ctx"),
    ("ours_us", "specdraft eager µs"),
    ("graph_us", "specdraft graph µs"),
    ("weight_mb", "weights MB"),
    ("kv_mb", "K/V MB"),
    ("floor_w_us", "weight floor µs"),
    ("floor_wkv_us", "w+K/V floor µs"),
    ("hf_us", "HF eager µs"),
    ("hf_over_ours", "HF / ours"),
    ("ours_over_floor", "eager / floor"),
    ("graph_over_floor", "graph / floor"),
]


def main(argv: list[str] | None = None) -> int:
    from tests.hf_compat import hide_repo_kernels_from_transformers

    hide_repo_kernels_from_transformers()  # transformers >= 5.25 would import our kernels/
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--ctx", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.models needs an NVIDIA GPU; the CPU tests cover the models' correctness")
        return 2
    from bench.common import environment, markdown_table, read_bandwidth_tbps, save_results

    env = environment()
    read_bw = read_bandwidth_tbps()
    print(f"{env['gpu']}: read {read_bw:.2f} TB/s; torch {env['torch']}", flush=True)
    rows = []
    for case in args.cases.split(","):
        built = build(case, args.ctx)
        for b in (int(x) for x in args.batches.split(",")):
            row = bench_case(case, b, args.ctx, args.iters, read_bw, built)
            rows.append(row)
            print(
                {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True
            )
        del built
        torch.cuda.empty_cache()
    import transformers

    env["transformers"] = transformers.__version__
    env["read_tbps"] = read_bw
    table = markdown_table(rows, COLUMNS)
    print(table)
    save_results(args.out, "models", {"env": env, "rows": rows}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
