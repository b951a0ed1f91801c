"""Flash-decoding merge: combines the per-split partial outputs by their log-sum-exp, and advances seq_lens.

The attention kernel, launched with ``USE_SPLIT_KV``, writes one normalised partial output and one log2-sum-exp
per (row, split). Because this merge runs after that launch completes (stream order), it is also the one
place where ``seq_lens`` can be advanced without racing the programs that read it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kv_splits_kernel(
    partial_out_ptr,  # [B, H_q, S_q, splits, D] fp32
    partial_lse_ptr,  # [B, H_q, S_q, splits] fp32, -inf for an empty split
    out_ptr,  # [B, H_q, S_q, D]
    seq_lens_ptr,  # [B] int32, advanced in place
    query_lens_ptr,  # [B] int32, read only when HAS_QUERY_LENS
    stride_p_b,
    stride_p_h,
    stride_p_s,
    stride_p_split,
    stride_p_d,
    stride_lse_b,
    stride_lse_h,
    stride_lse_s,
    stride_o_b,
    stride_o_h,
    stride_o_s,
    stride_o_d,
    num_q_heads,
    num_new,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_QUERY_LENS: tl.constexpr,
):
    pid_row = tl.program_id(0)  # over H_q * S_q
    batch = tl.program_id(1).to(tl.int64)
    head = (pid_row // num_new).to(tl.int64)
    token = pid_row % num_new
    offs_split = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_split = offs_split < num_splits
    mask_d = offs_d < HEAD_DIM

    lse_row_ptr = partial_lse_ptr + batch * stride_lse_b + head * stride_lse_h + token * stride_lse_s
    lse = tl.load(lse_row_ptr + offs_split, mask=mask_split, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # An all-empty row (padding) has lse_max = -inf: its weights become 0 and its output 0, never NaN.
    weights = tl.math.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    weight_sum = tl.sum(weights, 0)
    partial_row_ptr = partial_out_ptr + batch * stride_p_b + head * stride_p_h + token * stride_p_s
    mask_partial = mask_split[:, None] & mask_d[None, :] & (weights > 0.0)[:, None]
    partial = tl.load(
        partial_row_ptr + offs_split[:, None] * stride_p_split + offs_d[None, :] * stride_p_d,
        mask=mask_partial,
        other=0.0,
    )
    merged = tl.sum(partial * weights[:, None], 0) / tl.where(weight_sum > 0.0, weight_sum, 1.0)
    out_row_ptr = out_ptr + batch * stride_o_b + head * stride_o_h + token * stride_o_s
    tl.store(out_row_ptr + offs_d * stride_o_d, merged.to(out_ptr.dtype.element_ty), mask=mask_d)

    if pid_row == 0:
        if HAS_QUERY_LENS:
            row_new = tl.load(query_lens_ptr + batch)
        else:
            row_new = num_new
        tl.store(seq_lens_ptr + batch, tl.load(seq_lens_ptr + batch) + row_new)


def merge_kv_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
) -> None:
    batch, num_q_heads, num_new, num_splits, head_dim = partial_out.shape
    _merge_kv_splits_kernel[(num_q_heads * num_new, batch)](
        partial_out, partial_lse, out, seq_lens, query_lens if query_lens is not None else seq_lens,
        *partial_out.stride(), *partial_lse.stride()[:3], *out.stride(),
        num_q_heads, num_new, num_splits,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HAS_QUERY_LENS=query_lens is not None,
        num_warps=4 if head_dim > 64 else 2,
    )  # fmt: skip
