"""The KV cache as a plain ``(k_cache, v_cache, seq_lens)`` 3-tuple: allocation, reset and inspection.

The rules that govern what the tuple holds are stated once, in
:func:`flashcore.ops.attention_with_kv_cache`. This module only creates and reads such tuples; it launches no
kernels.
"""

from __future__ import annotations

import torch

from flashcore.backends import is_capturing_or_tracing

KVCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(k_cache [B, H_kv, S_max, D], v_cache [B, H_kv, S_max, D], seq_lens int32 [B])``."""

SEQ_LENS_DTYPE = torch.int32


def allocate_kv_cache(
    batch_size: int,
    num_kv_heads: int,
    max_len: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str | None = None,
) -> KVCache:
    """Preallocates an empty cache for :func:`~flashcore.attention_with_kv_cache`.

    The K and V buffers are uninitialised (``torch.empty``): the contract guarantees that memory past
    ``seq_lens`` never reaches an output, so there is nothing to zero.

    Every flashcore call reads the ``[B, H_kv, S_max, D]`` view, and any layout works; the storage is the one that
    the device's kernels read fastest. On CUDA each is a ``[B, S_max, H_kv, D]`` buffer seen as ``[B, H_kv, S_max,
    D]``: a token's heads sit together, so the decode programs of one sequence stream neighbouring memory (the H100
    kernels' fastest layout; benchmarks/NOTES.md, entry 35). Elsewhere (the CPU) it is contiguous ``[B, H_kv, S_max,
    D]``: the torch backend hands each head's prefix to ``F.scaled_dot_product_attention``, which reads a contiguous
    one faster (SmolLM2 decode at 3,000 tokens: 10% less CPU time per step; entry 39).

    Args:
        batch_size: B, the number of sequences.
        num_kv_heads: H_kv.
        max_len: S_max, the capacity of every row in tokens.
        head_dim: D.
        dtype: element type of K and V; must match the queries passed later.
        device: where the buffers live.

    Returns:
        ``(k_cache, v_cache, seq_lens)`` with ``seq_lens`` int32 zeros of shape ``[batch_size]``.
    """
    for name, value in (
        ("batch_size", batch_size),
        ("num_kv_heads", num_kv_heads),
        ("max_len", max_len),
        ("head_dim", head_dim),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if (torch.device(device) if device is not None else torch.get_default_device()).type == "cuda":
        storage_shape = (batch_size, max_len, num_kv_heads, head_dim)
        k_cache = torch.empty(storage_shape, dtype=dtype, device=device).transpose(1, 2)
        v_cache = torch.empty(storage_shape, dtype=dtype, device=device).transpose(1, 2)
    else:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        k_cache = torch.empty(shape, dtype=dtype, device=device)
        v_cache = torch.empty(shape, dtype=dtype, device=device)
    seq_lens = torch.zeros(batch_size, dtype=SEQ_LENS_DTYPE, device=device)
    return k_cache, v_cache, seq_lens


def reset_kv_cache(cache: KVCache) -> None:
    """Empties every row in place (``seq_lens[:] = 0``); K and V keep their now-garbage contents."""
    cache[2].zero_()


def rollback(cache: KVCache, num_tokens: int | torch.Tensor, *, check: bool | None = None) -> KVCache:
    """Forgets each row's last tokens, in place: ``seq_lens[b] -= n_b``. Returns the same tuple.

    The rollback of :func:`flashcore.attention_with_kv_cache`'s append (speculative decoding's rejected draft tokens,
    HF's ``Cache.crop``): K and V are not touched, and by the contract the positions ``>= seq_lens[b]`` are garbage
    again, so the next call writes over them. One in-place subtraction on ``seq_lens``' device, safe under CUDA-graph
    capture and ``torch.compile``.

    Args:
        cache: ``(k_cache, v_cache, seq_lens)``.
        num_tokens: ``n``, the same for every row (a Python int), or one per row (int32 ``[B]`` on ``seq_lens``'
            device).
        check: check ``0 <= n_b <= seq_lens[b]`` with one host read of the lengths, before anything changes. None
            means: check, unless a CUDA graph is being captured or ``torch.compile`` traces (a host read is not
            allowed there). Unchecked, a bad count is the caller's: a length below 0 reads as an empty row, and a
            length past what was written lets garbage reach an output.

    Raises:
        TypeError: ``num_tokens`` neither an int nor an int32 tensor.
        ValueError: ``num_tokens`` of the wrong shape or device, a negative count, or more tokens than a row holds
            (the message names the row); nothing changed.
    """
    seq_lens = cache[2]
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, torch.Tensor)):
        raise TypeError(f"num_tokens must be an int or an int32 tensor of shape [B], got {type(num_tokens).__name__}")
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.dtype != SEQ_LENS_DTYPE:
            raise TypeError(f"num_tokens must be torch.int32 like seq_lens, got {num_tokens.dtype}; use .int()")
        if num_tokens.shape != seq_lens.shape or num_tokens.device != seq_lens.device:
            raise ValueError(
                f"num_tokens must have seq_lens' shape {tuple(seq_lens.shape)} and device {seq_lens.device}, got "
                f"{tuple(num_tokens.shape)} on {num_tokens.device}"
            )
    elif num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0 (a rollback forgets tokens), got {num_tokens}")
    if check is None:
        check = not is_capturing_or_tracing()
    if check:
        lengths = seq_lens.tolist()
        counts = num_tokens.tolist() if isinstance(num_tokens, torch.Tensor) else [num_tokens] * len(lengths)
        for row, (length, count) in enumerate(zip(lengths, counts, strict=True)):
            if not 0 <= count <= length:
                raise ValueError(
                    f"cannot roll back {count} tokens of row {row}, which holds seq_lens[{row}] = {length}: "
                    f"num_tokens must be in [0, seq_lens[b]]; nothing changed"
                )
    seq_lens.sub_(num_tokens)
    return cache


def cached_keys_values(cache: KVCache, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns views ``(K [H_kv, L, D], V [H_kv, L, D])`` of the tokens row ``row`` holds.

    Reads ``seq_lens[row]`` on the host, so this is for inspection and tests, not for a hot path.
    """
    k_cache, v_cache, seq_lens = cache
    length = int(seq_lens[row])
    return k_cache[row, :, :length], v_cache[row, :, :length]
