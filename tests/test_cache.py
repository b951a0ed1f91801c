"""The ``(k_cache, v_cache, seq_lens)`` 3-tuple: allocation, reset, inspection, and allocation by the call."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, TOLERANCES, poison_, randn
from oracle import attention_oracle

import flashcore
from flashcore.ops import AttentionPlan

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_allocate_kv_cache(dtype, device):
    k_cache, v_cache, seq_lens = flashcore.allocate_kv_cache(3, 2, 17, 59, dtype=dtype, device=device)
    for tensor in (k_cache, v_cache):
        assert tensor.shape == (3, 2, 17, 59) and tensor.dtype == dtype and tensor.device == device
    assert k_cache.data_ptr() != v_cache.data_ptr()
    if device.type == "cuda":  # a token's heads sit together (the decode kernels' fastest): [B, S_max, H_kv, D]
        assert k_cache.stride() == v_cache.stride() == (17 * 2 * 59, 59, 2 * 59, 1)
    else:  # contiguous [B, H_kv, S_max, D], what the CPU's SDPA reads fastest
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (3,) and seq_lens.device == device
    assert seq_lens.tolist() == [0, 0, 0]


def test_allocate_kv_cache_defaults_to_float16():
    k_cache, v_cache, _ = flashcore.allocate_kv_cache(1, 1, 4, 8)
    assert k_cache.dtype == v_cache.dtype == torch.float16


@pytest.mark.parametrize("name", ["batch_size", "num_kv_heads", "max_len", "head_dim"])
@pytest.mark.parametrize("value", [0, -1, 2.0])
def test_allocate_kv_cache_rejects_bad_sizes(name, value):
    sizes = {"batch_size": 1, "num_kv_heads": 1, "max_len": 4, "head_dim": 8}
    sizes[name] = value
    with pytest.raises(ValueError, match=name):
        flashcore.allocate_kv_cache(*sizes.values())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_new", [1, 3])
def test_attention_plan_runs_every_layer_as_the_op(backend, dtype, num_new, device, generator):
    """An AttentionPlan made from one layer's call runs the other layers' calls as attention_with_kv_cache would:
    each layer's own cache is appended to and attended, against the fp64 oracle, garbage past the rows never read."""
    num_layers, batch, capacity, head_dim = 3, 2, 12, 16
    cached = [5, 2]
    caches = [
        flashcore.allocate_kv_cache(batch, 2, capacity, head_dim, dtype=dtype, device=device) for _ in range(num_layers)
    ]

    def draw(heads, length):
        return randn((batch, heads, length, head_dim), generator=generator, dtype=dtype, device=device)

    prefixes = []
    for k_cache, v_cache, seq_lens in caches:
        poison_(k_cache)
        poison_(v_cache)
        keys, values = draw(2, max(cached)), draw(2, max(cached))
        for row, length in enumerate(cached):
            k_cache[row, :, :length], v_cache[row, :, :length] = keys[row, :, :length], values[row, :, :length]
        seq_lens.copy_(torch.tensor(cached))
        prefixes.append((keys, values))
    steps = [(draw(4, num_new), draw(2, num_new), draw(2, num_new)) for _ in range(num_layers)]
    plan = AttentionPlan(*steps[0], caches[0], backend=backend)
    for (query, key, value), cache, (keys, values) in zip(steps, caches, prefixes, strict=True):
        out = plan.run(query, key, value, cache)
        assert cache[2].tolist() == [length + num_new for length in cached]
        all_keys = [torch.cat([keys[b, :, :n], key[b]], dim=1) for b, n in enumerate(cached)]
        all_values = [torch.cat([values[b, :, :n], value[b]], dim=1) for b, n in enumerate(cached)]
        expected = attention_oracle(query, all_keys, all_values, cached, [num_new] * batch, is_causal=True)
        torch.testing.assert_close(out.double(), expected, atol=TOLERANCES[dtype], rtol=0)


def test_attention_plan_checks_the_call_it_is_made_from(device):
    """The plan validates the call it is made from as the op does, with the op's message."""
    k_cache, v_cache, seq_lens = flashcore.allocate_kv_cache(1, 2, 8, 16, dtype=torch.float32, device=device)
    query = torch.zeros(1, 3, 1, 16, device=device)  # 3 query heads over 2 KV heads
    key = torch.zeros(1, 2, 1, 16, device=device)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        AttentionPlan(query, key, key, (k_cache, v_cache, seq_lens))


@pytest.mark.parametrize("backend", BACKENDS)
def test_reset_then_refill(backend, device, generator):
    """reset_kv_cache empties every row in place; the next call writes from position 0 and sees only itself."""
    dtype = DTYPES[0]
    cache = flashcore.allocate_kv_cache(2, 1, 8, 16, dtype=dtype, device=device)
    k_cache, v_cache, seq_lens = cache

    def draw(length):
        return [randn((2, heads, length, 16), generator=generator, dtype=dtype, device=device) for heads in (2, 1, 1)]

    flashcore.attention_with_kv_cache(*draw(5), cache, backend=backend)
    flashcore.reset_kv_cache(cache)
    assert cache[2] is seq_lens and seq_lens.tolist() == [0, 0]
    query, key, value = draw(3)
    out, returned = flashcore.attention_with_kv_cache(query, key, value, cache, backend=backend)
    assert returned[0] is k_cache and returned[1] is v_cache and returned[2] is seq_lens
    assert seq_lens.tolist() == [3, 3] and torch.equal(k_cache[:, :, :3], key)
    expected = attention_oracle(query, list(key), list(value), [0, 0], [3, 3], is_causal=True)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCES[dtype], rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_keys_values(backend, device, generator):
    """Views of exactly the seq_lens[row] tokens each row holds, in the caller's storage."""
    dtype = DTYPES[0]
    cache = flashcore.allocate_kv_cache(2, 2, 8, 16, dtype=dtype, device=device)
    poison_(cache[0])
    poison_(cache[1])

    def draw(heads):
        return randn((2, heads, 4, 16), generator=generator, dtype=dtype, device=device)

    query, key, value = draw(4), draw(2), draw(2)
    query_lens = torch.tensor([4, 2], dtype=torch.int32, device=device)
    flashcore.attention_with_kv_cache(query, key, value, cache, query_lens=query_lens, backend=backend)
    for row, length in enumerate([4, 2]):
        keys, values = flashcore.cached_keys_values(cache, row)
        assert keys.shape == values.shape == (2, length, 16)
        assert torch.equal(keys, key[row, :, :length]) and torch.equal(values, value[row, :, :length])
        assert keys.data_ptr() == cache[0][row].data_ptr() and values.data_ptr() == cache[1][row].data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_call_allocates_the_cache(backend, dtype, device, generator):
    """past_key_value=None with cache_max_len: a fresh cache of that capacity, in the query's dtype, that a
    decode step can then continue."""
    num_new, capacity = 5, 9

    def draw(heads, length):
        return randn((2, heads, length, 24), generator=generator, dtype=dtype, device=device)

    query, key, value = draw(6, num_new), draw(3, num_new), draw(3, num_new)
    query_lens = torch.tensor([num_new, 2], dtype=torch.int32, device=device)
    out, cache = flashcore.attention_with_kv_cache(
        query, key, value, query_lens=query_lens, cache_max_len=capacity, backend=backend
    )
    k_cache, v_cache, seq_lens = cache
    assert k_cache.shape == v_cache.shape == (2, 3, capacity, 24)
    assert k_cache.dtype == dtype and k_cache.device == device
    assert seq_lens.dtype == torch.int32 and seq_lens.tolist() == [num_new, 2]
    assert torch.equal(k_cache[1, :, :2], key[1, :, :2]) and torch.equal(v_cache[0, :, :num_new], value[0])
    lens = [num_new, 2]
    keys = [key[b, :, :n] for b, n in enumerate(lens)]
    values = [value[b, :, :n] for b, n in enumerate(lens)]
    expected = attention_oracle(query, keys, values, [0, 0], lens, is_causal=True)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCES[dtype], rtol=0)

    step_query, step_key, step_value = draw(6, 1), draw(3, 1), draw(3, 1)
    out, returned = flashcore.attention_with_kv_cache(step_query, step_key, step_value, cache, backend=backend)
    assert all(a is b for a, b in zip(returned, cache, strict=True)) and seq_lens.tolist() == [num_new + 1, 3]
    keys = [torch.cat([k, step_key[b]], dim=1) for b, k in enumerate(keys)]
    values = [torch.cat([v, step_value[b]], dim=1) for b, v in enumerate(values)]
    expected = attention_oracle(step_query, keys, values, lens, [1, 1], is_causal=True)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCES[dtype], rtol=0)
