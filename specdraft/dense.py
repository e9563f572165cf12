"""Dense, differentiable PyTorch forwards of the decoder layers over right-padded
batches [B, T] (positions 0 .. T - 1, causal attention): the target's features for
training a draft head, and the head's own training forward.

The math is the runtime's (specdraft.layers with specdraft.torch_ops) without a paged
cache: RMSNorm rounds the normalised value to the input dtype before the weight, rotary
is the rotate-half layout read from the model's cos/sin table, attention scales by
head_dim^-0.5. A layer is read through its attributes (self_attn.qkv_proj,
self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj, the two norms), so the same functions
run specdraft's inference modules and the training head's nn.Linear modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .models.llama import LlamaForCausalLM


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(x.dtype).float() * weight.float()).to(x.dtype)


def rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated at positions 0 .. T - 1; cos_sin [>= T, D] float32
    (cos in the first half of a row, sin in the second)."""
    half = cos_sin.shape[1] // 2
    rows = cos_sin[: x.shape[2]]
    cos, sin = rows[:, :half], rows[:, half:]
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def _linear(module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def project_qkv(attn, x: torch.Tensor, cos_sin: torch.Tensor):
    """q [B, H, T, D] and k, v [B, H_kv, T, D] of one layer, q and k rotated."""
    b, t, _ = x.shape
    d = attn.head_dim
    qkv = _linear(attn.qkv_proj, x)
    q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(b, t, attn.num_heads, d).transpose(1, 2)
    k = k.view(b, t, attn.num_kv_heads, d).transpose(1, 2)
    v = v.view(b, t, attn.num_kv_heads, d).transpose(1, 2)
    return rotate(q, cos_sin), rotate(k, cos_sin), v


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., T, D] moved n rows later along T (row i holds row i - n; zeros first)."""
    if n == 0:
        return x
    return F.pad(x, (0, 0, n, 0))[..., : x.shape[-2], :]


def unrolled_attention(
    q: torch.Tensor, kv_steps: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Attention of draft step s = len(kv_steps) - 1 unrolled over a whole sequence.

    Step 0 reads the target's features at every position; step s at position i reads
    the head's own output of step s - 1 at i - 1. At run time the query of step s at
    position i sees the cache as a draft round leaves it: keys of step 0 (verified
    tokens) at positions j <= i - s, then the key that step t wrote at position
    i - s + t for t = 1 .. s (its own last). kv_steps[t] = (k, v) of step t, each
    [B, H_kv, T, D]; q [B, H, T, D]. Returns [B, H, T, D]."""
    s = len(kv_steps) - 1
    t_len = q.shape[2]
    groups = q.shape[1] // kv_steps[0][0].shape[1]
    scale = q.shape[-1] ** -0.5
    if s == 0:
        k, v = kv_steps[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
    pos = torch.arange(t_len, device=q.device)
    k0, v0 = (_expand(x, groups) for x in kv_steps[0])
    scores = [(q @ k0.transpose(-1, -2)) * scale]
    scores[0] = scores[0].masked_fill(pos[None, :] > pos[:, None] - s, float("-inf"))
    values = []
    for t in range(1, s + 1):
        lag = s - t
        kt, vt = (_shift(_expand(x, groups), lag) for x in kv_steps[t])
        diag = (q * kt).sum(-1, keepdim=True) * scale  # [B, H, T, 1]
        scores.append(diag.masked_fill((pos < lag)[:, None], float("-inf")))
        values.append(vt)
    probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :t_len] @ v0
    for t, vt in enumerate(values):
        out = out + probs[..., t_len + t : t_len + t + 1] * vt
    return out


def layer_forward(
    layer,
    h: torch.Tensor,
    cos_sin: torch.Tensor,
    eps: float,
    kv_steps: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """One pre-norm decoder layer over [B, T, h] (input norm skipped where the layer has
    none, as in EAGLE-1's layer 0). kv_steps: the keys and values of earlier unrolled
    draft steps (see unrolled_attention); this step's are appended to it."""
    attn = layer.self_attn
    norm = layer.input_layernorm
    x = h if norm is None else rms_norm(h, norm.weight, eps)
    q, k, v = project_qkv(attn, x, cos_sin)
    steps = [] if kv_steps is None else kv_steps
    steps.append((k, v))
    a = unrolled_attention(q, steps)
    b, _, t, _ = a.shape
    h = h + _linear(attn.o_proj, a.transpose(1, 2).reshape(b, t, -1))
    x = rms_norm(h, layer.post_attention_layernorm.weight, eps)
    gate, up = _linear(layer.mlp.gate_up_proj, x).chunk(2, dim=-1)
    return h + _linear(layer.mlp.down_proj, (F.silu(gate.float()) * up.float()).to(up.dtype))


@torch.no_grad()
def target_hidden(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The target's final hidden states (after its final RMSNorm: what the runtime keeps
    for an EAGLE-1 head) [B, T, h] for right-padded token ids [B, T]; rows of padding
    are computed and meaningless."""
    cfg, cos_sin = model.cfg, model.rotary.cos_sin_cache
    if ids.shape[1] > cos_sin.shape[0]:
        raise ValueError(
            f"sequences of {ids.shape[1]} tokens are over the model's rotary table "
            f"({cos_sin.shape[0]} positions)"
        )
    h = F.embedding(ids, model.embed_tokens.weight)
    for layer in model.layers:
        h = layer_forward(layer, h, cos_sin, cfg.rms_norm_eps)
    return rms_norm(h, model.norm.weight, cfg.rms_norm_eps)
