"""Flash-decoding merge: combines the per-split partial outputs by their log-sum-exp, and advances seq_lens.

With ``USE_SPLIT_KV`` the attention kernel splits each row's cached prefix over several programs; each writes
a normalised partial output and its log2-sum-exp. This second launch merges them. Because it runs after the
attention launch completes (stream order), it is also where ``seq_lens`` advances without racing a reader.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashcore.kernels.launch import CachedLauncher


@triton.jit
def _merge_kv_splits_kernel(
    partial_out_ptr,  # [B * H_q * S_q, splits, HEAD_DIM] fp32
    partial_lse_ptr,  # [B * H_q * S_q, splits] fp32, -inf for a split that saw no key
    out_ptr,  # [B, H_q, S_q, HEAD_DIM], contiguous
    seq_lens_ptr,  # [B] int32, advanced in place
    query_lens_ptr,  # [B] int32, read only when HAS_QUERY_LENS
    rows_per_batch,  # H_q * S_q
    num_new,  # S_q
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_QUERY_LENS: tl.constexpr,
):
    pid_row = tl.program_id(0)  # over H_q * S_q
    batch = tl.program_id(1).to(tl.int64)
    row = batch * rows_per_batch + pid_row
    offs_split = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_split = offs_split < num_splits
    mask_d = offs_d < HEAD_DIM

    # All splits of the row are loaded at once: one round trip to memory, not one per split.
    lse = tl.load(partial_lse_ptr + row * num_splits + offs_split, mask=mask_split, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # A row whose splits are all empty (a padding row) has lse_max = -inf: weights 0, output 0, never NaN.
    weights = tl.math.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    weight_sum = tl.sum(weights, 0)
    partial_ptrs = partial_out_ptr + (row * num_splits + offs_split)[:, None] * HEAD_DIM + offs_d[None, :]
    partial = tl.load(partial_ptrs, mask=mask_split[:, None] & mask_d[None, :], other=0.0)
    merged = tl.sum(partial * weights[:, None], 0) / tl.where(weight_sum > 0.0, weight_sum, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, merged.to(out_ptr.dtype.element_ty), mask=mask_d)

    if pid_row == 0:
        if HAS_QUERY_LENS:
            row_new = tl.load(query_lens_ptr + batch)
        else:
            row_new = num_new
        tl.store(seq_lens_ptr + batch, tl.load(seq_lens_ptr + batch) + row_new)


_launch_merge = CachedLauncher(_merge_kv_splits_kernel)


def merge_kv_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
) -> None:
    """Writes ``out`` from the partials of :func:`attention_with_kv_cache_triton` and advances ``seq_lens``."""
    batch, num_q_heads, num_new, head_dim = out.shape
    num_splits = partial_out.shape[1]
    _launch_merge(
        (num_q_heads * num_new, batch, 1),
        (
            partial_out, partial_lse, out, seq_lens, query_lens if query_lens is not None else seq_lens,
            num_q_heads * num_new, num_new, num_splits,
        ),
        dict(
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HAS_QUERY_LENS=query_lens is not None,
        ),
        num_warps=4 if head_dim > 64 else 2,
        num_stages=3,
    )  # fmt: skip
