"""``torch.sdpa``: the torch backend's fast path, an in-place append and ``F.scaled_dot_product_attention``.

The reference (``flashcore/reference.py``) rewrites the whole cached prefix through masks and materialises the
full score matrix each call, which made CPU decode at 3,000 tokens ~3x slower than stock transformers (issue 26).
This kernel reads ``seq_lens`` (and ``query_lens``) on the host once, writes only the new slots, and hands each
row's written prefix to SDPA, so it never loads a slot past a row's end and garbage there cannot reach an output.
A batch whose rows share their length and new-token count is one SDPA call; any other batch is one call per row
(the CPU's batches are small). Grouped query heads read each K/V head once, without a ``repeat_interleave`` copy:
through SDPA's ``enable_gqa`` where no mask is needed (decode), packed into one KV head's rows
(``[B, H_kv, group * S_q, D]``) where one is. A decode step over at least ``MATMUL_DECODE_MIN_KV_LEN`` cached tokens
attends with two GEMMs instead, which the CPU runs faster than SDPA there.

The host read is illegal while a CUDA graph is being captured or ``torch.compile`` traces; the reference, which
has no host read there, takes those calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashcore.backends import is_capturing_or_tracing
from flashcore.kernels.call import KernelCall

NAME = "torch.sdpa"
MATMUL_DECODE_MIN_KV_LEN = 1024  # from here on a decode step attends with two GEMMs instead of SDPA (see _attend)


def supports(call: KernelCall) -> bool:
    """Every call where ``seq_lens`` may be read on the host: not under graph capture or compile tracing."""
    return not is_capturing_or_tracing()


def run(call: KernelCall) -> torch.Tensor:
    """The contract of :func:`flashcore.ops.attention_with_kv_cache`, for a validated call."""
    query, key, value, k_cache, v_cache, seq_lens, query_lens, is_causal, scale, sliding_window = call
    batch, _, num_new, _ = query.shape
    capacity = k_cache.shape[2]
    if num_new == 0 or batch == 0:
        return torch.empty_like(query)
    lengths = seq_lens.tolist()
    news = query_lens.tolist() if query_lens is not None else None
    start = lengths[0]
    # The list methods run in C: this test is on every call's host path (a decode step's cost on the CPU).
    if (
        0 <= start <= capacity - num_new
        and lengths.count(start) == batch
        and (news is None or news.count(num_new) == batch)
    ):
        # -- uniform batch: one append, one SDPA call --
        # Slice assignment: one call per tensor for the write (narrow + copy_ was two, and more host time).
        k_cache[:, :, start : start + num_new] = key
        v_cache[:, :, start : start + num_new] = value
        # The cache's copy even where the row was empty: HF's new keys are [B, S, H, D] storage, whose strided heads
        # SDPA read 1.0% slower than the cache's rows at a 3,000-token prefill (benchmarks/NOTES.md, entry 48).
        keys, values = k_cache.narrow(2, 0, start + num_new), v_cache.narrow(2, 0, start + num_new)
        out = _attend(query, keys, values, start, is_causal, scale, sliding_window)
        seq_lens.fill_(start + num_new)  # every row held `start`: the same as add_, with less host time
        return out.contiguous()
    # -- one row at a time; padding rows (i >= n_b) stay zero --
    # As the reference does, should check=False let a bad length through: a negative length counts as 0, and
    # tokens past capacity are attended by their queries but not stored.
    cached = [min(max(length, 0), capacity) for length in lengths]
    news = news if news is not None else [num_new] * batch
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    for b in range(batch):
        start, new = cached[b], news[b]
        if new == 0:
            continue
        end = min(start + new, capacity)
        k_cache[b, :, start:end] = key[b, :, : end - start]
        v_cache[b, :, start:end] = value[b, :, : end - start]
        rows = slice(b, b + 1)
        out[rows, :, :new] = _attend(
            query[rows, :, :new],
            k_cache[rows, :, :end],
            v_cache[rows, :, :end],
            start,
            is_causal,
            scale,
            sliding_window,
        )
    seq_lens.add_(query_lens if query_lens is not None else num_new)
    return out.contiguous()


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    is_causal: bool,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """``query [B, H_q, n, D]`` over every slot of ``keys``/``values [B, H_kv, kv_len, D]``, all of them written;
    new token i sits at position ``start + i``. Returns ``[B, H_q, n, D]``."""
    batch, num_q_heads, num_new, head_dim = query.shape
    num_kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = num_q_heads // num_kv_heads
    # The window hides slot j from position p when j <= p - W; no slot is hidden when the last position is < W.
    has_window = sliding_window > 0 and start + num_new - 1 >= sliding_window
    # Causal hides slots > p; a single new token sits at (or, past capacity, after) the last slot and sees them all.
    has_causal = is_causal and num_new > 1
    if has_causal and not has_window and start == 0 and num_new == kv_len:
        # A prefill on an empty row: bottom-right is top-left, and SDPA's own causal path skips masked blocks.
        return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=group > 1)
    mask = None
    if has_causal or has_window:
        positions = torch.arange(start, start + num_new, device=query.device)[:, None]
        slots = torch.arange(kv_len, device=query.device)[None, :]
        mask = torch.ones(num_new, kv_len, dtype=torch.bool, device=query.device)
        if has_causal:
            mask &= slots <= positions
        if has_window:
            mask &= slots > positions - sliding_window
    if mask is None and num_new == 1 and kv_len >= MATMUL_DECODE_MIN_KV_LEN:
        # Long decode: two batched GEMMs over the packed query heads and a softmax between them. On the CPU this beat
        # SDPA's kernel from about 1k cached tokens on (SmolLM2's attention at 3k: 25.2 against 29.4 ms per step of a
        # 30-layer model with a narrow MLP; benchmarks/NOTES.md, entry 48).
        packed = query.reshape(batch, num_kv_heads, group, head_dim)
        scores = torch.matmul(packed, keys.transpose(-1, -2)).mul_(scale)
        return torch.matmul(scores.softmax(dim=-1), values).view(batch, num_q_heads, 1, head_dim)
    if mask is None:  # SDPA's own GQA path, which reads each K/V head once
        return F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=group > 1)
    mask = mask.repeat(group, 1)  # the packed rows: group copies of the n queries
    packed = query.reshape(batch, num_kv_heads, group * num_new, head_dim)
    out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_q_heads, num_new, head_dim)
