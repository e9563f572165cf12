"""Triton kernels and their launchers; shipped as `specdraft.kernels`.

This package imports torch and triton only, never the runtime."""

from .activation import check_silu_and_mul_args, silu_and_mul
from .argmax import argmax_rows, check_argmax_args
from .commit import check_commit_args, commit_step, commit_step_torch
from .embedding import (
    check_embed_concat_args,
    check_embed_fc_args,
    check_embed_rows_args,
    check_resolve_fed_ids_args,
    embed_concat,
    embed_fc,
    embed_fc_supported,
    embed_rows,
    resolve_fed_ids,
)
from .fused_linear import (
    check_fused_linear_args,
    fused_linear,
    fused_qkv_rope,
    fused_qkv_rope_supported,
    late_meta_supported,
    max_fused_rows,
)
from .gemv import check_linear_small_m_args, linear_small_m
from .guard import INTERPRET, check_tensors_runnable, runnable
from .kv_store import check_store_kv_args, store_kv
from .launch import pdl_supported
from .linear_int8 import (
    argmax_blocks,
    check_linear_int8_args,
    check_linear_int8_partials_args,
    linear_int8,
    linear_int8_partials,
    quantize_rows_int8,
    resolve_act_int8,
)
from .paged_attention import (
    AttentionLaunchConfig,
    AttentionSplits,
    check_paged_attention_args,
    choose_launch_config,
    combine_splits,
    num_sms,
    paged_attention,
    paged_attention_unmerged,
)
from .rejection import (
    RejectionConfig,
    RejectionWorkspace,
    check_rejection_args,
    choose_rejection_config,
    rejection_sample,
)
from .rmsnorm import check_rms_norm_args, rms_norm
from .rotary import (
    apply_rotary,
    check_rotary_args,
    check_rotary_store_kv_args,
    rotary_store_kv,
)
from .sampling import (
    SampleConfig,
    SampleWorkspace,
    check_sample_args,
    choose_sample_config,
    gather_params,
    sample_tokens,
    sample_workspace,
)
from .slot_mapping import as_int, compute_slot_mapping, prepare_slot_mapping
from .validation import set_validation, use_validation, validation_enabled
from .verify import check_verify_prepare_args, verify_prepare

# The public launchers refuse CPU tensors without the interpreter and bf16 under it,
# with a message that says what to do (kernels/guard.py).
silu_and_mul = runnable(silu_and_mul)
argmax_rows = runnable(argmax_rows)
commit_step = runnable(commit_step)
embed_concat = runnable(embed_concat)
embed_fc = runnable(embed_fc)
embed_rows = runnable(embed_rows)
resolve_fed_ids = runnable(resolve_fed_ids)
linear_small_m = runnable(linear_small_m)
linear_int8 = runnable(linear_int8)
linear_int8_partials = runnable(linear_int8_partials)
fused_linear = runnable(fused_linear)
fused_qkv_rope = runnable(fused_qkv_rope)
store_kv = runnable(store_kv)
paged_attention = runnable(paged_attention)
paged_attention_unmerged = runnable(paged_attention_unmerged)
rms_norm = runnable(rms_norm)
apply_rotary = runnable(apply_rotary)
rotary_store_kv = runnable(rotary_store_kv)
compute_slot_mapping = runnable(compute_slot_mapping)
rejection_sample = runnable(rejection_sample)
sample_tokens = runnable(sample_tokens)
gather_params = runnable(gather_params)
verify_prepare = runnable(verify_prepare)

__all__ = [
    "AttentionLaunchConfig",
    "AttentionSplits",
    "INTERPRET",
    "RejectionConfig",
    "RejectionWorkspace",
    "SampleConfig",
    "SampleWorkspace",
    "apply_rotary",
    "argmax_blocks",
    "argmax_rows",
    "as_int",
    "check_argmax_args",
    "check_commit_args",
    "check_embed_concat_args",
    "check_embed_fc_args",
    "check_fused_linear_args",
    "check_linear_int8_args",
    "check_linear_int8_partials_args",
    "check_linear_small_m_args",
    "check_paged_attention_args",
    "check_rejection_args",
    "check_embed_rows_args",
    "check_resolve_fed_ids_args",
    "check_rms_norm_args",
    "check_rotary_args",
    "check_rotary_store_kv_args",
    "check_sample_args",
    "check_silu_and_mul_args",
    "check_store_kv_args",
    "check_tensors_runnable",
    "check_verify_prepare_args",
    "choose_launch_config",
    "choose_rejection_config",
    "choose_sample_config",
    "combine_splits",
    "commit_step",
    "commit_step_torch",
    "compute_slot_mapping",
    "embed_concat",
    "embed_fc",
    "embed_fc_supported",
    "fused_linear",
    "fused_qkv_rope",
    "fused_qkv_rope_supported",
    "late_meta_supported",
    "max_fused_rows",
    "gather_params",
    "linear_int8",
    "linear_int8_partials",
    "linear_small_m",
    "num_sms",
    "paged_attention",
    "paged_attention_unmerged",
    "pdl_supported",
    "prepare_slot_mapping",
    "quantize_rows_int8",
    "resolve_act_int8",
    "rejection_sample",
    "embed_rows",
    "resolve_fed_ids",
    "rms_norm",
    "rotary_store_kv",
    "sample_tokens",
    "sample_workspace",
    "set_validation",
    "silu_and_mul",
    "store_kv",
    "use_validation",
    "validation_enabled",
    "verify_prepare",
]
