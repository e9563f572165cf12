"""A decoder layer's tail in one persistent launch: O projection + residual, RMSNorm +
gate/up + SiLU-and-multiply, down projection + residual.

On the fused decode path these are three rows-kernel launches (kernels.fused_linear),
four when attention splits its keys (the merge). At a few rows each reads little (0.66
to 1.8 MB for SmolLM2-135M) and costs about a launch's latency, so a layer's tail is
mostly boundaries between dependent launches. Here one launch of at most one program a
multiprocessor runs the three phases over its column tiles, the programs meeting at a
grid barrier (kernels.grid_sync) between phases. Each phase is the rows kernel's own
product (the same helpers and tiles, so the same bits as the three launches): a program
loads its next tile's weights, then waits, then reads x. The O phase merges split
attention's partials on its loads (as fused_linear's x_splits) when its K runs hold
whole heads; otherwise the merge launch runs first.

With programmatic dependent launch the first phase waits on griddepcontrol for the
attention launch; the later phases wait on the barrier only. Every program of a
persistent launch must be resident at once: the grid is at most one program a
multiprocessor, and under the interpreter (programs run one after another) one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_linear import (
    MAX_ROWS,
    ROWS_MAX_K,
    _check_x_splits,
    _rows_gemv,
    _rows_tile,
    check_fused_linear_args,
)
from .fused_mma import _epilogue
from .grid_sync import grid_arrive, grid_counter, grid_reset
from .guard import INTERPRET
from .launch import CachedLaunch, pdl_launch, specialization_key
from .paged_attention import AttentionSplits, combine_splits, num_sms


@triton.jit
def _rows_phase(x_ptr, w_ptr, b_ptr, g_ptr, out_ptr, M, N, K, eps, stride_x, stride_w,
                stride_o, pid, nprog, bar_ptr, target, sp_out_ptr, sp_lse_ptr, qsl_ptr,
                num_reqs, KH1: tl.constexpr, KH2: tl.constexpr, KL: tl.constexpr,
                BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                NORM: tl.constexpr, GLU: tl.constexpr, RES: tl.constexpr, GDC: tl.constexpr,
                BAR: tl.constexpr, MERGE: tl.constexpr, NQH: tl.constexpr, HD: tl.constexpr,
                NSPLIT: tl.constexpr, PART_MAX: tl.constexpr):  # fmt: skip
    """One rows-kernel projection over this program's column tiles (every nprog-th from
    pid). RES: out is the residual stream, read at L2 (another phase of this launch may
    have written it). BAR: wait for `target` arrivals before reading x."""
    for t in range(pid, tl.cdiv(N, BLOCK_N), nprog):
        n0 = t * BLOCK_N
        rr = tl.arange(0, ROWS)[None, :, None, None]
        nn = n0 + tl.arange(0, BLOCK_N)[:, None, None, None]
        rows = tl.arange(0, ROWS)[None, :]
        cols = n0 + tl.arange(0, BLOCK_N)[:, None]
        omask = (rows < M) & (cols < N)
        bias, bias_u, res = 0.0, 0.0, 0.0
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            if GLU:
                bias_u = tl.load(b_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc, acc_u = _rows_gemv(x_ptr, w_ptr, g_ptr, nn, rr, M, N, K, eps, stride_x, stride_w,
                                KH1, KH2, KL, NORM, GLU, GDC, sp_out_ptr, sp_lse_ptr, qsl_ptr,
                                num_reqs, MERGE, NQH, HD, NSPLIT, PART_MAX, bar_ptr, target,
                                BAR)  # fmt: skip
        if RES:
            res = tl.load(out_ptr + rows * stride_o + cols, mask=omask, other=0.0,
                          cache_modifier=".cg").to(tl.float32)  # fmt: skip
        acc = _epilogue(acc, acc_u, bias, bias_u, res, HAS_BIAS, GLU, RES)
        tl.store(out_ptr + rows * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _layer_tail_kernel(
    x_ptr, s_ptr, a_ptr, wo_ptr, bo_ptr, g_ptr, wgu_ptr, bgu_ptr, wd_ptr, bd_ptr, bar_ptr,
    M, H, KO, F, eps, stride_x, stride_s, stride_a, stride_wo, stride_wgu, stride_wd,
    sp_out_ptr, sp_lse_ptr, qsl_ptr, num_reqs,
    KH1O: tl.constexpr, KH2O: tl.constexpr, KLO: tl.constexpr, BNO: tl.constexpr,
    KH1G: tl.constexpr, KH2G: tl.constexpr, KLG: tl.constexpr, BNG: tl.constexpr,
    KH1D: tl.constexpr, KH2D: tl.constexpr, KLD: tl.constexpr, BND: tl.constexpr,
    ROWS: tl.constexpr, HAS_BO: tl.constexpr, HAS_BGU: tl.constexpr, HAS_BD: tl.constexpr,
    GDC: tl.constexpr, MERGE: tl.constexpr, NQH: tl.constexpr, HD: tl.constexpr,
    NSPLIT: tl.constexpr, PART_MAX: tl.constexpr,
):  # fmt: skip
    """s += O(x); a = silu(gate) * up of norm(s); s += down(a). x [M, KO] (or split
    attention's partials, MERGE), s [M, H] the residual stream, a [M, F]."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    _rows_phase(x_ptr, wo_ptr, bo_ptr, wo_ptr, s_ptr, M, H, KO, eps, stride_x, stride_wo,
                stride_s, pid, nprog, bar_ptr, 0, sp_out_ptr, sp_lse_ptr, qsl_ptr, num_reqs,
                KH1O, KH2O, KLO, BNO, ROWS, HAS_BO, False, False, True, GDC, False, MERGE,
                NQH, HD, NSPLIT, PART_MAX)  # fmt: skip
    grid_arrive(bar_ptr)
    _rows_phase(s_ptr, wgu_ptr, bgu_ptr, g_ptr, a_ptr, M, F, H, eps, stride_s, stride_wgu,
                stride_a, pid, nprog, bar_ptr, nprog, s_ptr, s_ptr, s_ptr, 0, KH1G, KH2G, KLG,
                BNG, ROWS, HAS_BGU, True, True, False, False, True, False, 1, 1, 1,
                1.0)  # fmt: skip
    grid_arrive(bar_ptr)
    _rows_phase(a_ptr, wd_ptr, bd_ptr, wd_ptr, s_ptr, M, H, F, eps, stride_a, stride_wd,
                stride_s, pid, nprog, bar_ptr, 2 * nprog, s_ptr, s_ptr, s_ptr, 0, KH1D, KH2D,
                KLD, BND, ROWS, HAS_BD, False, False, True, False, True, False, 1, 1, 1,
                1.0)  # fmt: skip
    old = grid_arrive(bar_ptr)
    grid_reset(bar_ptr, old, 3 * nprog)


_TAIL_LAUNCH = CachedLaunch(_layer_tail_kernel)
# The layers' switch (specdraft.layers.forward_fused): off until the H200 shows the
# persistent tail beating the three launches it replaces (bench.decode_step --tail).
TAIL_FUSED = False


def fused_layer_tail_supported(rows: int, hidden: int, q_width: int, intermediate: int) -> bool:
    """Whether fused_layer_tail takes `rows` rows of a layer with these widths: the rows
    kernel's shapes (at most MAX_ROWS rows, every K at most ROWS_MAX_K)."""
    return 1 <= rows <= MAX_ROWS and max(hidden, q_width, intermediate) <= ROWS_MAX_K


def _programs(device: torch.device, tiles: int, programs: int | None) -> int:
    if INTERPRET:
        return 1
    limit = num_sms(device)
    if programs is None:
        return max(1, min(limit, tiles))
    if not 1 <= programs <= limit:
        raise ValueError(f"programs {programs}: a grid barrier takes 1 to {limit} (one an SM)")
    return programs


def check_fused_layer_tail_args(x, stream, o_weight, norm_weight, gate_up_weight, down_weight,
                                *, o_bias=None, gate_up_bias=None, down_bias=None, act=None,
                                x_splits=None) -> None:  # fmt: skip
    """fused_layer_tail's argument checks (nothing launched)."""
    check_fused_linear_args(x, o_weight, bias=o_bias, residual=stream, out=stream)
    _check_x_splits(x, x_splits)
    check_fused_linear_args(stream, gate_up_weight, bias=gate_up_bias, norm_weight=norm_weight,
                            glu=True, out=act)  # fmt: skip
    f = gate_up_weight.shape[0] // 2
    if tuple(down_weight.shape[1:]) != (f,):
        raise ValueError(
            f"down_weight has shape {tuple(down_weight.shape)}, expected [{stream.shape[1]}, {f}]"
        )
    if act is None:  # the down projection's x: a stand-in of act's shape (nothing written)
        act = torch.empty((x.shape[0], f), dtype=x.dtype, device=x.device)
    check_fused_linear_args(act, down_weight, bias=down_bias, residual=stream, out=stream)
    m, h = stream.shape
    if not fused_layer_tail_supported(m, h, x.shape[1], f):
        raise ValueError(
            f"fused_layer_tail takes 1 to {MAX_ROWS} rows and widths up to {ROWS_MAX_K}: "
            f"rows {m}, hidden {h}, x {x.shape[1]}, intermediate {f}"
        )


def fused_layer_tail(
    x: torch.Tensor,
    stream: torch.Tensor,
    o_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    o_bias: torch.Tensor | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    act: torch.Tensor | None = None,
    x_splits: AttentionSplits | None = None,
    pdl: bool = False,
    programs: int | None = None,
) -> torch.Tensor:
    """stream += x o_weight^T; act = silu(g) * u with [g | u] = RMSNorm(stream;
    norm_weight, eps) gate_up_weight^T; stream += act down_weight^T. One launch; the
    same outputs, bit for bit, as the three fused_linear calls (O + residual, norm +
    gate/up with glu=True, down + residual). Returns act [M, F] (allocated when None).
    x_splits: as fused_linear's. programs: the persistent grid (default: one program a
    multiprocessor, at most the largest phase's column tiles)."""
    check_fused_layer_tail_args(x, stream, o_weight, norm_weight, gate_up_weight, down_weight,
                                o_bias=o_bias, gate_up_bias=gate_up_bias, down_bias=down_bias,
                                act=act, x_splits=x_splits)  # fmt: skip
    m, h = stream.shape
    ko, f = x.shape[1], gate_up_weight.shape[0] // 2
    if act is None:
        act = torch.empty((m, f), dtype=stream.dtype, device=stream.device)
    elem = x.element_size()
    tile_o, tile_g, tile_d = _rows_tile(ko, elem), _rows_tile(h, elem), _rows_tile(f, elem)
    merge = False
    if x_splits is not None:
        hd = x_splits.out.shape[2]
        merge = tile_o[2] % hd == 0 and hd == x_splits.part_out.shape[-1]
        if not merge:
            combine_splits(x_splits, pdl=pdl)
    if merge:
        sp = x_splits
        split = (sp.part_out, sp.part_lse, sp.query_start_loc, sp.num_reqs)
        split_c = (True, sp.out.shape[1], sp.out.shape[2], sp.num_splits, sp.part_max)
    else:
        split, split_c = (x, x, x, 0), (False, 1, 1, 1, 1.0)
    tiles = max(triton.cdiv(h, tile_o[3]), triton.cdiv(f, tile_g[3]), triton.cdiv(h, tile_d[3]))
    grid = _programs(stream.device, tiles, programs)
    counter = grid_counter(stream.device)
    gdc, options = pdl_launch(pdl)
    biases = (o_bias, gate_up_bias, down_bias)
    bo, bgu, bd = (b if b is not None else o_weight for b in biases)
    args = (x, stream, act, o_weight, bo, norm_weight, gate_up_weight, bgu, down_weight, bd,
            counter, m, h, ko, f, float(eps), x.stride(0), stream.stride(0), act.stride(0),
            o_weight.stride(0), gate_up_weight.stride(0), down_weight.stride(0), *split,
            *tile_o[:4], *tile_g[:4], *tile_d[:4], triton.next_power_of_2(m),
            *(b is not None for b in biases), gdc, *split_c)  # fmt: skip
    key = specialization_key(args) + (stream.device.index, grid)
    _TAIL_LAUNCH(key, (grid,), args, {"num_warps": tile_o[4], **options})
    return act
