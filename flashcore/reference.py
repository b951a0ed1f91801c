"""The ``torch`` backend: :func:`flashcore.ops.attention_with_kv_cache`'s contract in plain, vectorised PyTorch.

It is the CPU default and a readable statement of the semantics. Every step works over the first ``kv_len``
cache slots with masks. ``kv_len`` is the longest row after the call, read on the host once, which keeps CPU
decode proportional to the conversation rather than to ``S_max``; while a CUDA graph is being captured (HF's
compiled decode step) no host read is allowed, so it is ``S_max`` there. The triton backend is the fast one.
"""

from __future__ import annotations

import torch

from flashcore.kernels.call import KernelCall

NAME = "torch.reference"


def supports(call: KernelCall) -> bool:
    """Every validated call, on any device."""
    return True


def run(call: KernelCall) -> torch.Tensor:
    """The contract of :func:`flashcore.ops.attention_with_kv_cache`, for a validated call."""
    query, key, value, k_cache, v_cache, seq_lens, query_lens, is_causal, scale, sliding_window = call
    batch, num_q_heads, num_new, head_dim = query.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    if num_new == 0:
        return torch.empty_like(query)
    new_tokens = query_lens if query_lens is not None else torch.full_like(seq_lens, num_new)
    cached = seq_lens.clamp(0, capacity)  # as the kernel does, should check=False let a bad length through
    ends = (cached + new_tokens).clamp(max=capacity)
    is_capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
    kv_len = capacity if is_capturing else int(ends.max())
    slots = torch.arange(kv_len, device=query.device)
    new_offsets = torch.arange(num_new, device=query.device)
    is_new_token = new_offsets[None, :] < new_tokens[:, None]  # [B, S_q]

    # -- append: slot p of row b takes new token p - L_b when that is one of the row's n_b new tokens --
    source = slots[None, :] - cached[:, None]  # [B, kv_len]
    is_new_slot = ((source >= 0) & (source < new_tokens[:, None]))[:, None, :, None]
    gather_index = source.clamp(0, num_new - 1)[:, None, :, None].expand(batch, num_kv_heads, kv_len, head_dim)
    k_prefix, v_prefix = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
    k_prefix.copy_(torch.where(is_new_slot, key.gather(2, gather_index), k_prefix))
    v_prefix.copy_(torch.where(is_new_slot, value.gather(2, gather_index), v_prefix))

    # -- attend over the written slots; garbage is zeroed before it can meet a 0 * NaN --
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    is_written = slots[None, :] < ends[:, None]  # [B, kv_len]
    group = num_q_heads // num_kv_heads
    keys = torch.where(is_written[:, None, :, None], k_prefix, 0).to(compute_dtype).repeat_interleave(group, dim=1)
    values = torch.where(is_written[:, None, :, None], v_prefix, 0).to(compute_dtype).repeat_interleave(group, dim=1)

    scores = torch.matmul(query.to(compute_dtype), keys.transpose(-1, -2)) * scale  # [B, H_q, S_q, kv_len]
    query_positions = (cached[:, None] + new_offsets[None, :])[:, :, None]  # [B, S_q, 1]
    is_visible = is_written[:, None, :].expand(batch, num_new, kv_len)
    if is_causal:
        is_visible = is_visible & (slots[None, None, :] <= query_positions)
    if sliding_window:
        is_visible = is_visible & (slots[None, None, :] > query_positions - sliding_window)
    scores = scores.masked_fill(~is_visible[:, None], float("-inf"))
    # Only padding rows (i >= n_b) can be fully masked; their NaN is replaced (not multiplied) by zero.
    out = torch.matmul(torch.softmax(scores, dim=-1), values)
    out = torch.where(is_new_token[:, None, :, None], out, 0).to(query.dtype)

    seq_lens.add_(new_tokens)
    return out
