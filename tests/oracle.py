"""The test oracle for one ``attention_with_kv_cache`` call: fp64 attention, poisoned inputs, contract checks.

:func:`attention_oracle` is plain fp64 softmax attention, one row at a time, written from the contract in
``flashcore.ops.attention_with_kv_cache`` and sharing no code with flashcore. :func:`make_call_inputs` builds
a call whose every unused byte is NaN (cache past ``seq_lens``, padding tokens past ``query_lens``), and
:func:`check_call` asserts every rule of the contract after the call: output against the oracle, appended
slots bitwise, untouched slots still NaN, ``seq_lens`` advanced, padding rows exactly zero, same objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

NAN = float("nan")


def attention_oracle(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    seq_lens: list[int],
    query_lens: list[int],
    *,
    is_causal: bool,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Expected output in fp64.

    Args:
        query: ``[B, H_q, S_q, D]``.
        keys, values: per row b, ``[H_kv, seq_lens[b] + query_lens[b], D]``: the cached prefix then the
            new tokens, i.e. every token row b holds after the call.
        seq_lens: tokens cached before the call, per row.
        query_lens: valid new tokens per row (the first ones of ``S_q``).

    Returns:
        ``[B, H_q, S_q, D]`` float64; rows ``i >= query_lens[b]`` are zero.
    """
    batch, num_q_heads, num_new, head_dim = query.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(batch, num_q_heads, num_new, head_dim, dtype=torch.float64, device=query.device)
    for b in range(batch):
        cached, new = seq_lens[b], query_lens[b]
        if new == 0:
            continue
        k, v = keys[b].double(), values[b].double()
        assert k.shape[1] == cached + new, "keys[b] must hold the cached prefix and the new tokens"
        group = num_q_heads // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        q = query[b, :, :new].double()
        scores = (q @ k.transpose(-1, -2)) * scale  # [H_q, new, cached + new]
        query_pos = cached + torch.arange(new, device=query.device)[:, None]
        key_pos = torch.arange(cached + new, device=query.device)[None, :]
        is_visible = torch.ones_like(scores[0], dtype=torch.bool)
        if is_causal:
            is_visible &= key_pos <= query_pos  # bottom-right: new token i sits at position cached + i
        if sliding_window is not None:
            # The window bounds the past only: (p - W, p] when causal, (p - W, end) when not.
            is_visible &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~is_visible, -math.inf)
        out[b, :, :new] = torch.softmax(scores, dim=-1) @ v
    return out


@dataclass
class CallInputs:
    """One call's arguments, plus clones of what the cache held before it."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    seq_lens: list[int]
    query_lens: list[int]
    k_cache_before: torch.Tensor
    v_cache_before: torch.Tensor


def make_call_inputs(
    randn,
    *,
    generator: torch.Generator,
    dtype: torch.dtype,
    device,
    num_q_heads: int,
    num_kv_heads: int,
    num_new: int,
    head_dim: int,
    capacity: int,
    seq_lens: list[int],
    query_lens: list[int],
) -> CallInputs:
    """N(0, 1) q/k/v and cached tokens; NaN in the cache past ``seq_lens`` and in padding tokens.

    ``randn`` is conftest's helper, passed in so that this module imports nothing from the test setup.
    """
    batch = len(seq_lens)
    query = randn((batch, num_q_heads, num_new, head_dim), generator=generator, dtype=dtype, device=device)
    key = randn((batch, num_kv_heads, num_new, head_dim), generator=generator, dtype=dtype, device=device)
    value = randn((batch, num_kv_heads, num_new, head_dim), generator=generator, dtype=dtype, device=device)
    cache_shape = (batch, num_kv_heads, capacity, head_dim)
    k_cache = randn(cache_shape, generator=generator, dtype=dtype, device=device)
    v_cache = randn(cache_shape, generator=generator, dtype=dtype, device=device)
    for b, (cached, new) in enumerate(zip(seq_lens, query_lens, strict=True)):
        k_cache[b, :, cached:] = NAN
        v_cache[b, :, cached:] = NAN
        for tensor in (query, key, value):
            tensor[b, :, new:] = NAN
    seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return CallInputs(
        query=query,
        key=key,
        value=value,
        cache=(k_cache, v_cache, seq_lens_tensor),
        seq_lens=list(seq_lens),
        query_lens=list(query_lens),
        k_cache_before=k_cache.clone(),
        v_cache_before=v_cache.clone(),
    )


def expected_output(
    inputs: CallInputs, *, is_causal: bool, scale: float | None = None, sliding_window: int | None = None
) -> torch.Tensor:
    """The oracle over the tokens each row holds after the call (taken from the pre-call clones)."""
    keys, values = [], []
    for b, (cached, new) in enumerate(zip(inputs.seq_lens, inputs.query_lens, strict=True)):
        keys.append(torch.cat([inputs.k_cache_before[b, :, :cached], inputs.key[b, :, :new]], dim=1))
        values.append(torch.cat([inputs.v_cache_before[b, :, :cached], inputs.value[b, :, :new]], dim=1))
    return attention_oracle(
        inputs.query,
        keys,
        values,
        inputs.seq_lens,
        inputs.query_lens,
        is_causal=is_causal,
        scale=scale,
        sliding_window=sliding_window,
    )


def check_call(
    inputs: CallInputs,
    out: torch.Tensor,
    returned_cache,
    *,
    atol: float,
    is_causal: bool,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> None:
    """Asserts every rule of the contract for a call made with ``inputs`` that returned ``out``."""
    k_cache, v_cache, seq_lens = inputs.cache
    assert returned_cache[0] is k_cache and returned_cache[1] is v_cache and returned_cache[2] is seq_lens
    assert out.shape == inputs.query.shape and out.dtype == inputs.query.dtype
    assert out.device == inputs.query.device
    assert torch.isfinite(out).all(), "garbage (NaN cache or padding) reached the output"

    expected = expected_output(inputs, is_causal=is_causal, scale=scale, sliding_window=sliding_window)
    error = (out.double() - expected).abs().max().item() if out.numel() else 0.0
    assert error <= atol, f"max abs error {error:.3g} > {atol:.3g} against the fp64 oracle"

    new_lens = [cached + new for cached, new in zip(inputs.seq_lens, inputs.query_lens, strict=True)]
    assert seq_lens.tolist() == new_lens, "seq_lens must advance by exactly query_lens, in place"
    for b, (cached, new) in enumerate(zip(inputs.seq_lens, inputs.query_lens, strict=True)):
        assert torch.equal(out[b, :, new:], torch.zeros_like(out[b, :, new:])), f"row {b}: padding not zero"
        for name, cache, before, appended in (
            ("k_cache", k_cache, inputs.k_cache_before, inputs.key),
            ("v_cache", v_cache, inputs.v_cache_before, inputs.value),
        ):
            assert torch.equal(cache[b, :, :cached], before[b, :, :cached]), f"{name}[{b}]: prefix changed"
            assert torch.equal(cache[b, :, cached : cached + new], appended[b, :, :new]), (
                f"{name}[{b}]: appended slots differ from the new tokens"
            )
            assert cache[b, :, cached + new :].isnan().all(), f"{name}[{b}]: wrote past the new end"


def with_heads_interleaved_caches(inputs: CallInputs) -> CallInputs:
    """The same call with its caches copied into ``[B, S_max, H_kv, D]`` buffers seen as ``[B, H_kv, S_max, D]``
    (each token's heads together): the layout ``flashcore.allocate_kv_cache`` gives."""

    def interleave(cache: torch.Tensor) -> torch.Tensor:
        return cache.transpose(1, 2).contiguous().transpose(1, 2)

    k_cache, v_cache, seq_lens = inputs.cache
    return replace(inputs, cache=(interleave(k_cache), interleave(v_cache), seq_lens))
