"""The ``torch`` backend: :func:`flashcore.ops.attention_with_kv_cache`'s contract in plain, vectorised PyTorch.

It is the CPU default and a readable statement of the semantics. It does the append with one indexed
write and the attention over the cache prefix with explicit masks, computing in float32 at least. It reads
the longest row length on the host once per call to bound the work; that sync is fine on the CPU, and the
triton backend is the one for graph capture.
"""

from __future__ import annotations

import torch


def attention_with_kv_cache_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """Same arguments and contract as :func:`flashcore.ops.attention_with_kv_cache` (validated already)."""
    batch, num_q_heads, num_new, _ = query.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    new_offsets = torch.arange(num_new, device=query.device)
    new_tokens = query_lens if query_lens is not None else torch.full_like(seq_lens, num_new)
    is_new_token = new_offsets[None, :] < new_tokens[:, None]  # [B, S_q]
    new_positions = seq_lens[:, None] + new_offsets[None, :]  # [B, S_q]

    # -- append new K/V: only valid tokens, and never past capacity --
    is_stored = is_new_token & (new_positions < capacity)
    rows, offsets = is_stored.nonzero(as_tuple=True)
    positions = new_positions[rows, offsets]
    k_cache[rows, :, positions] = key[rows, :, offsets]
    v_cache[rows, :, positions] = value[rows, :, offsets]

    # -- attend over [0, seq_lens + query_lens), garbage zeroed before it can meet a 0 * NaN --
    kv_len = min(int((seq_lens + new_tokens).max()), capacity) if batch else 0
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    key_positions = torch.arange(kv_len, device=query.device)
    is_written = key_positions[None, :] < (seq_lens + new_tokens).clamp(max=capacity)[:, None]  # [B, kv_len]
    keys = torch.where(is_written[:, None, :, None], k_cache[:, :, :kv_len], 0).to(compute_dtype)
    values = torch.where(is_written[:, None, :, None], v_cache[:, :, :kv_len], 0).to(compute_dtype)
    group = num_q_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)

    scores = torch.matmul(query.to(compute_dtype), keys.transpose(-1, -2)) * scale  # [B, H_q, S_q, kv_len]
    query_positions = new_positions[:, :, None]  # [B, S_q, 1]
    is_visible = is_written[:, None, :].expand(batch, num_new, kv_len)
    if is_causal:
        is_visible = is_visible & (key_positions[None, None, :] <= query_positions)
    if sliding_window:
        is_visible = is_visible & (key_positions[None, None, :] > query_positions - sliding_window)
    scores = scores.masked_fill(~is_visible[:, None], float("-inf"))
    # Only padding rows (i >= n_b) can be fully masked; their NaN is replaced (not multiplied) by zero.
    out = torch.matmul(torch.softmax(scores, dim=-1), values)
    out = torch.where(is_new_token[:, None, :, None], out, 0).to(query.dtype)

    seq_lens.add_(new_tokens)
    return out
