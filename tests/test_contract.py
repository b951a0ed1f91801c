"""The contract of ``flashcore.attention_with_kv_cache``, checked on both backends against independent oracles.

Per-step decode against causal SDPA; mixed batches in one call; the coverage sweep (head dims, dtypes,
causal, sliding window); the garbage rule; non-contiguous inputs and caches; backend dispatch. Every call
is checked by :func:`oracle.check_call`, which also asserts the cache rules (appended slots bitwise, the
rest still NaN, ``seq_lens`` advanced, padding rows zero, the same tensor objects returned). The triton
kernel's tile, launch-order and split-KV edges are in test_contract_tiling.py.

On the CPU the triton cases run in the interpreter (~0.1-1 s a launch); the shapes are kept small enough
that the whole sweep runs there too, not just on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cases import BACKENDS, call_with_query_lens, inputs_maker
from conftest import DTYPES, TOLERANCES, poison_, randn
from oracle import check_call

import flashcore
import flashcore.backends
from flashcore import reference
from flashcore.kernels.torch import sdpa as torch_sdpa
from flashcore.kernels.triton import attention as triton_attention


@pytest.fixture
def make_inputs(generator, device):
    """Builds a call's inputs (:func:`cases.inputs_maker`): fresh N(0, 1) data from this test's generator."""
    return inputs_maker(generator, device)


def _sdpa_fp64(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool):
    """SDPA in fp64. Its causal mask is top-left aligned, so it is only used with S_q == S_kv; a decode
    step instead passes K[:p + 1] and is_causal=False, which is the bottom-right mask for one query."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(query.double(), key.double(), value.double(), is_causal=is_causal)


def _tokens_at(tensor: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """``[B, H, 1, D]``: the token at ``positions[b]`` of each row b of a ``[B, H, S, D]`` sequence."""
    return torch.stack([tensor[b, :, p : p + 1] for b, p in enumerate(positions)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (9, 3)])
def test_prefill_then_decode_matches_sdpa_each_step(backend, dtype, num_q_heads, num_kv_heads, device, generator):
    """Prefill prompts of different lengths (query_lens pads the shorter), then decode 10 tokens one by one.

    After each step t, row b's output must equal causal SDPA over ``K[:L_b + t + 1]``, ``V[:L_b + t + 1]``.
    """
    batch, head_dim, capacity, num_steps = 2, 64, 48, 10
    prompt_lens = [13, 7]
    prompt_len = max(prompt_lens)
    total = prompt_len + num_steps

    def draw(num_heads):
        return randn((batch, num_heads, total, head_dim), generator=generator, dtype=dtype, device=device)

    queries, keys, values = draw(num_q_heads), draw(num_kv_heads), draw(num_kv_heads)
    cache = flashcore.allocate_kv_cache(batch, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
    poison_(cache[0])
    poison_(cache[1])
    atol = TOLERANCES[dtype]

    query_lens = torch.tensor(prompt_lens, dtype=torch.int32, device=device)
    out, returned = flashcore.attention_with_kv_cache(
        queries[:, :, :prompt_len],
        keys[:, :, :prompt_len],
        values[:, :, :prompt_len],
        cache,
        query_lens=query_lens,
        backend=backend,
    )
    assert all(a is b for a, b in zip(returned, cache, strict=True))
    for b, length in enumerate(prompt_lens):
        expected = _sdpa_fp64(
            queries[b : b + 1, :, :length],
            keys[b : b + 1, :, :length],
            values[b : b + 1, :, :length],
            is_causal=True,
        )
        torch.testing.assert_close(out[b : b + 1, :, :length].double(), expected, atol=atol, rtol=0)
        assert torch.equal(out[b, :, length:], torch.zeros_like(out[b, :, length:]))

    # Decode: step t appends token prompt_lens[b] + t of row b; rows stay at different lengths.
    for step in range(num_steps):
        positions = [length + step for length in prompt_lens]
        query, key, value = (_tokens_at(t, positions) for t in (queries, keys, values))
        out, _ = flashcore.attention_with_kv_cache(query, key, value, cache, backend=backend)
        assert cache[2].tolist() == [p + 1 for p in positions]
        for b, position in enumerate(positions):
            expected = _sdpa_fp64(
                queries[b : b + 1, :, position : position + 1],
                keys[b : b + 1, :, : position + 1],
                values[b : b + 1, :, : position + 1],
                is_causal=False,
            )
            torch.testing.assert_close(out[b : b + 1].double(), expected, atol=atol, rtol=0)
            assert torch.equal(cache[0][b, :, : position + 1], keys[b, :, : position + 1])
            assert torch.equal(cache[1][b, :, : position + 1], values[b, :, : position + 1])
            assert cache[0][b, :, position + 1 :].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 8, 64])
@pytest.mark.parametrize("is_causal", [True, False])
def test_mixed_batch_in_one_call(backend, dtype, group, is_causal, generator, make_inputs):
    """Prefill rows next to a decode row, an empty-cache row, a row exactly full after the call, a row with
    no new tokens, and random cached lengths, all in one call."""
    num_kv_heads = 1 if group == 64 else 2
    num_new, head_dim, capacity = 17, 64, 40
    random_lens = torch.randint(1, capacity - num_new, (2,), generator=generator).tolist()
    #            prefill       prefill        decode  empty  full after  no new tokens
    seq_lens = [random_lens[0], random_lens[1], 21, 0, capacity - 9, 5]
    query_lens = [num_new, 11, 1, num_new, 9, 0]
    inputs = make_inputs(
        dtype=dtype,
        num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = call_with_query_lens(inputs, is_causal=is_causal, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [24, 59, 64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("num_new", [1, 9])
def test_coverage(backend, head_dim, dtype, is_causal, sliding_window, num_new, generator, make_inputs):
    """Head dims (odd 59 included), dtypes, causal or not, with or without a window, decode and a short
    prefill; GQA 9/3, rows at different lengths, one exactly full after the call and longer than the window
    plus the new tokens."""
    capacity = num_new + 24
    seq_lens = torch.randint(0, capacity - num_new + 1, (3,), generator=generator).tolist()
    seq_lens[0] = capacity - num_new  # exactly full after the call
    query_lens = [num_new, max(1, num_new - 4), num_new]
    inputs = make_inputs(
        dtype=dtype,
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=head_dim,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = call_with_query_lens(inputs, is_causal=is_causal, sliding_window=sliding_window, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal, sliding_window=sliding_window)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_new", [1, 12])
def test_garbage_never_reaches_the_output(backend, num_new, make_inputs):
    """NaN everywhere the contract says is unused: the cache past seq_lens, and the padding tokens past
    query_lens in q, k and v. Also a custom scale, so that the default is not the only one tested."""
    dtype = DTYPES[0]
    seq_lens, query_lens = [0, 19, 7], [num_new, num_new, num_new // 2]
    inputs = make_inputs(
        dtype=dtype, num_q_heads=4, num_kv_heads=2, head_dim=32, capacity=40, seq_lens=seq_lens, query_lens=query_lens
    )
    assert inputs.cache[0].isnan().any() and inputs.query.isnan().any()
    out, returned = call_with_query_lens(inputs, scale=0.3, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True, scale=0.3)


def _hf_layout(tensor: torch.Tensor) -> torch.Tensor:
    """Same values, stored [B, S, H, D] and seen as [B, H, S, D], as HF passes q/k/v."""
    batch, heads, length, dim = tensor.shape
    return tensor.new_empty(batch, length, heads, dim).transpose(1, 2).copy_(tensor)


def _padded_cache_view(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [B, S_max, H_kv, D + 8] buffer of 7s seen as [B, H_kv, S_max, D]; returns (buffer, view)."""
    batch, heads, capacity, dim = cache.shape
    buffer = torch.full((batch, capacity, heads, dim + 8), 7.0, dtype=cache.dtype, device=cache.device)
    return buffer, buffer.transpose(1, 2)[..., :dim].copy_(cache)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_new", [1, 5])
@pytest.mark.parametrize(
    "strided",
    ["q_k_v_hf_layout", "value_unlike_key", "cache_views", "v_cache_unlike_k_cache"],
)
def test_non_contiguous_inputs_and_cache(backend, num_new, strided, device, make_inputs):
    """Any strides, one tensor class at a time: q/k/v as HF passes them, value strided unlike key, caches
    that are views into padded [B, S_max, H_kv, D + 8] buffers (writes must land in the caller's storage),
    and v_cache strided unlike k_cache. (Strided seq_lens / query_lens are rejected: tests/test_errors.py.)"""
    dtype = DTYPES[0]
    inputs = make_inputs(
        dtype=dtype,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=40,
        capacity=24,
        seq_lens=[9, 3],
        query_lens=[num_new, max(1, num_new - 2)],
    )
    k_cache, v_cache, seq_lens = inputs.cache
    query_lens = torch.tensor(inputs.query_lens, dtype=torch.int32, device=device)
    buffers = []
    if strided == "q_k_v_hf_layout":
        inputs.query, inputs.key, inputs.value = (_hf_layout(t) for t in (inputs.query, inputs.key, inputs.value))
    elif strided == "value_unlike_key":
        inputs.value = _hf_layout(inputs.value)
    elif strided == "cache_views":
        (k_buffer, k_cache), (v_buffer, v_cache) = _padded_cache_view(k_cache), _padded_cache_view(v_cache)
        buffers = [k_buffer, v_buffer]
    else:
        v_buffer, v_cache = _padded_cache_view(v_cache)
        buffers = [v_buffer]
    inputs.cache = (k_cache, v_cache, seq_lens)

    out, returned = flashcore.attention_with_kv_cache(
        inputs.query, inputs.key, inputs.value, inputs.cache, query_lens=query_lens, backend=backend
    )
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True)
    for buffer in buffers:
        assert (buffer[..., -8:] == 7).all(), "wrote into the padding of a strided cache"


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_backend_dispatch(backend, device, kernels_run, make_inputs):
    """With "auto", triton runs on CUDA or under TRITON_INTERPRET=1 and torch otherwise; an explicit choice
    is kept."""
    runs_triton = device.type == "cuda" or flashcore.backends.triton_interpreter_enabled()
    expected = {"auto": "triton" if runs_triton else "torch", "torch": "torch", "triton": "triton"}[backend]
    expected = {"torch": torch_sdpa.NAME, "triton": triton_attention.NAME}[expected]

    dtype = DTYPES[0]
    inputs = make_inputs(
        dtype=dtype, num_q_heads=2, num_kv_heads=1, head_dim=16, capacity=8, seq_lens=[2, 5], query_lens=[3, 3]
    )
    out, returned = flashcore.attention_with_kv_cache(
        inputs.query, inputs.key, inputs.value, inputs.cache, backend=backend
    )
    assert kernels_run == [expected]
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True)


def test_auto_picks_torch_without_interpreter(monkeypatch, kernels_run, make_inputs):
    """On CPU tensors without TRITON_INTERPRET=1, "auto" is the torch backend and it works."""
    monkeypatch.setattr(flashcore.backends, "triton_interpreter_enabled", lambda: False)
    inputs = make_inputs(
        dtype=torch.float32,
        device="cpu",
        num_q_heads=3,
        num_kv_heads=3,
        head_dim=8,
        capacity=6,
        seq_lens=[4],
        query_lens=[2],
    )
    out, returned = flashcore.attention_with_kv_cache(inputs.query, inputs.key, inputs.value, inputs.cache)
    assert kernels_run == [torch_sdpa.NAME]
    check_call(inputs, out, returned, atol=TOLERANCES[torch.float32], is_causal=True)


def test_torch_backend_runs_the_reference_where_host_reads_are_illegal(monkeypatch, kernels_run, make_inputs):
    """torch.sdpa reads seq_lens on the host, which CUDA-graph capture and torch.compile tracing forbid; there the
    torch backend's row goes on to the reference, which has no host read in that context."""
    monkeypatch.setattr(torch_sdpa, "is_capturing_or_tracing", lambda: True)
    inputs = make_inputs(
        dtype=DTYPES[0], num_q_heads=6, num_kv_heads=2, head_dim=16, capacity=12, seq_lens=[3, 7], query_lens=[4, 2]
    )
    out, returned = call_with_query_lens(inputs, backend="torch")
    assert kernels_run == [reference.NAME]
    check_call(inputs, out, returned, atol=TOLERANCES[DTYPES[0]], is_causal=True)


@pytest.mark.parametrize(("seq_lens", "query_lens"), [([1100, 1100], [1, 1]), ([1030, 1500, 20], [1, 0, 1])])
def test_torch_backend_long_decode_attends_with_gemms(seq_lens, query_lens, monkeypatch, kernels_run, make_inputs):
    """A decode step over at least MATMUL_DECODE_MIN_KV_LEN tokens takes torch.sdpa's two-GEMM path, not SDPA (a
    uniform batch; rows of their own, one short, one idle); every rule of the contract holds, the NaN garbage past
    each row's end included."""
    sdpa_kv_lens, sdpa = [], F.scaled_dot_product_attention

    def counting_sdpa(query, key, value, **kwargs):
        sdpa_kv_lens.append(key.shape[2])
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch_sdpa.F, "scaled_dot_product_attention", counting_sdpa)
    inputs = make_inputs(
        dtype=torch.float32,
        device="cpu",
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=16,
        capacity=1600,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = call_with_query_lens(inputs, backend="torch")
    assert kernels_run == [torch_sdpa.NAME]
    short_rows = [length + 1 for length, new in zip(seq_lens, query_lens, strict=True) if new and length < 1000]
    assert sdpa_kv_lens == short_rows
    check_call(inputs, out, returned, atol=TOLERANCES[torch.float32], is_causal=True)
