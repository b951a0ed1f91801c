"""The contract of ``flashcore.attention_with_kv_cache``, checked on both backends against independent oracles.

Per-step decode against causal SDPA; mixed batches in one call; the coverage sweep (head dims, dtypes,
causal, sliding window); the garbage rule; non-contiguous inputs and caches; backend dispatch. Every call
is checked by :func:`oracle.check_call`, which also asserts the cache rules (appended slots bitwise, the
rest still NaN, ``seq_lens`` advanced, padding rows zero, the same tensor objects returned).

On the CPU the triton cases run in the interpreter (~0.1-1 s a launch); the shapes are kept small enough
that the whole sweep runs there too, not just on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, TOLERANCES, poison_, randn
from oracle import CallInputs, check_call, make_call_inputs

import flashcore
import flashcore.backends
from flashcore.kernels.configs import NEW_TOKENS_TILE, num_sms
from flashcore.kernels.triton import attention as triton_attention
from flashcore.kernels.triton import split_merge

BACKENDS = ["torch", "triton"]
# The triton backend merges a split prefix either in the attention launch (eager) or in a second launch
# (under CUDA-graph capture); the split-KV tests force each placement so that both run on every device.
SPLIT_MERGE_CASES = [
    pytest.param("torch", None, id="torch"),
    pytest.param("triton", True, id="triton-merge_in_launch"),
    pytest.param("triton", False, id="triton-merge_second_launch"),
]


@pytest.fixture
def split_merge_placement(monkeypatch):
    """Call with True/False to force where the triton backend merges split partials (None: leave the policy)."""

    def force(merges_in_launch: bool | None) -> None:
        if merges_in_launch is not None:
            monkeypatch.setattr(split_merge, "merges_in_attention_launch", lambda device: merges_in_launch)

    return force


def _sdpa_fp64(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool):
    """SDPA in fp64. Its causal mask is top-left aligned, so it is only used with S_q == S_kv; a decode
    step instead passes K[:p + 1] and is_causal=False, which is the bottom-right mask for one query."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(query.double(), key.double(), value.double(), is_causal=is_causal)


def _call_with_query_lens(inputs: CallInputs, **kwargs):
    """The call under test, with ``query_lens`` passed as an int32 tensor even where it equals S_q."""
    query_lens = torch.tensor(inputs.query_lens, dtype=torch.int32, device=inputs.query.device)
    return flashcore.attention_with_kv_cache(
        inputs.query, inputs.key, inputs.value, inputs.cache, query_lens=query_lens, **kwargs
    )


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
def test_mixed_batch_in_one_call(backend, dtype, group, is_causal, device, generator):
    """Prefill rows next to a decode row, an empty-cache row, a row exactly full after the call, a row with
    no new tokens, and random cached lengths, all in one call."""
    num_kv_heads = 1 if group == 64 else 2
    num_new, head_dim, capacity = 17, 64, 40
    random_lens = torch.randint(1, capacity - num_new, (2,), generator=generator).tolist()
    #            prefill       prefill        decode  empty  full after  no new tokens
    seq_lens = [random_lens[0], random_lens[1], 21, 0, capacity - 9, 5]
    query_lens = [num_new, 11, 1, num_new, 9, 0]
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        num_new=num_new,
        head_dim=head_dim,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = _call_with_query_lens(inputs, is_causal=is_causal, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [24, 59, 64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("num_new", [1, 9])
def test_coverage(backend, head_dim, dtype, is_causal, sliding_window, num_new, device, generator):
    """Head dims (odd 59 included), dtypes, causal or not, with or without a window, decode and a short
    prefill; GQA 9/3, rows at different lengths, one exactly full after the call and longer than the window
    plus the new tokens."""
    capacity = num_new + 24
    seq_lens = torch.randint(0, capacity - num_new + 1, (3,), generator=generator).tolist()
    seq_lens[0] = capacity - num_new  # exactly full after the call
    query_lens = [num_new, max(1, num_new - 4), num_new]
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=9,
        num_kv_heads=3,
        num_new=num_new,
        head_dim=head_dim,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = _call_with_query_lens(inputs, is_causal=is_causal, sliding_window=sliding_window, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal, sliding_window=sliding_window)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [59, 256])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_long_prefill(backend, head_dim, is_causal, sliding_window, device, generator):
    """70 new tokens over GQA 2/1: enough packed rows for the large prefill tiles, several key tiles of new
    tokens, a diagonal that crosses tile edges, and a window edge inside the new tokens."""
    dtype = DTYPES[-1]
    seq_lens, query_lens = [0, int(torch.randint(1, 40, (1,), generator=generator))], [70, 53]
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=2,
        num_kv_heads=1,
        num_new=70,
        head_dim=head_dim,
        capacity=120,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = _call_with_query_lens(inputs, is_causal=is_causal, sliding_window=sliding_window, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal, sliding_window=sliding_window)


@pytest.mark.parametrize("num_new", [NEW_TOKENS_TILE, NEW_TOKENS_TILE + 1])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_new_tokens_one_tile_or_loop(num_new, is_causal, sliding_window, device, generator):
    """Both ways the triton kernel attends to the new tokens: as one tile loaded before the cached prefix
    (at most NEW_TOKENS_TILE of them) and through the tiled loop (one more), with rows of fewer valid new
    tokens, an empty cache, a window edge among the new tokens and one in the cache. GQA 16/2 packs 128 rows at
    NEW_TOKENS_TILE tokens: the prefill-sized M tile meets the one-tile path."""
    dtype = DTYPES[-1]
    capacity = num_new + 90
    seq_lens = [int(torch.randint(20, 90, (1,), generator=generator)), 0, 90]
    query_lens = [num_new, 3, num_new - 5]
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=16,
        num_kv_heads=2,
        num_new=num_new,
        head_dim=64,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = _call_with_query_lens(inputs, is_causal=is_causal, sliding_window=sliding_window, backend="triton")
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal, sliding_window=sliding_window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize(
    ("group", "num_new"),
    [
        pytest.param(4, NEW_TOKENS_TILE, id="decode_tile_64_rows"),
        pytest.param(8, NEW_TOKENS_TILE, id="prefill_tile_new_tokens_tile"),
        pytest.param(4, NEW_TOKENS_TILE + 1, id="prefill_tile_loop"),
    ],
)
def test_largest_tiles_fit_and_match(dtype, head_dim, group, num_new, device, generator):
    """Each launch config at its largest shared-memory footprint: the widest row (fp32, head dim up to 256) with
    the most packed rows of its M tile, with and without the new tokens' one-tile load. On the GPU a config that
    needs more shared memory than the SM has fails to launch (the fuzz test found one, fp32 at head dim 252:
    NOTES.md entry 28); everywhere, the output must still match the oracle."""
    capacity = num_new + 70
    seq_lens = [int(torch.randint(1, 71, (1,), generator=generator)), 0]
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=group,
        num_kv_heads=1,
        num_new=num_new,
        head_dim=head_dim,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=[num_new, num_new - 3],
    )
    out, returned = _call_with_query_lens(inputs, is_causal=True, backend="triton")
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True, sliding_window=None)


@pytest.mark.parametrize("rows_per_group", [1, 2, 3, 4])
def test_launch_order_groups(rows_per_group, monkeypatch, device, generator):
    """Prefill of 3 M blocks over 4 (batch, KV head) rows, the launch order grouping 1, 2, 3 or all 4 rows (with
    3, the last group short; configs.rows_per_launch_group picks the size from L2): every (row, M block) program
    runs once, so each output matches the oracle and seq_lens advances exactly once."""
    monkeypatch.setattr(triton_attention.configs, "rows_per_launch_group", lambda *shape: rows_per_group)
    triton_attention._launch_plan.cache_clear()
    try:
        dtype = DTYPES[-1]
        inputs = make_call_inputs(
            randn,
            generator=generator,
            dtype=dtype,
            device=device,
            num_q_heads=4,
            num_kv_heads=2,
            num_new=160,  # 320 packed rows: 3 M blocks of 128
            head_dim=32,
            capacity=200,
            seq_lens=[int(n) for n in torch.randint(0, 41, (2,), generator=generator)],
            query_lens=[160, 97],
        )
        plan = triton_attention._launch_plan(320, 32, 4, 200, dtype.itemsize, torch.device(device))
        assert (plan.num_m_blocks, plan.rows_per_group) == (3, rows_per_group)
        out, returned = _call_with_query_lens(inputs, is_causal=True, backend="triton")
        check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True)
    finally:
        triton_attention._launch_plan.cache_clear()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_new", "cached"), [(150, 0), (40, 150), (1, 190)])
def test_row_max_jumps_between_key_tiles(backend, num_new, cached, device, generator):
    """Keys whose scale jumps between 64-key tiles (x1, x1.2, x5, x5 by position), so the online softmax's running
    row max grows a little, then a lot (keys x5: scores of standard deviation ~5), then not at all, across the
    cached prefix and the new tokens: prefill (128-row M blocks), a chunk on a cache, and decode."""
    dtype = DTYPES[-1]
    inputs = make_call_inputs(
        randn, generator=generator, dtype=dtype, device=device, num_q_heads=4, num_kv_heads=2,
        num_new=num_new, head_dim=32, capacity=200, seq_lens=[cached], query_lens=[num_new],
    )  # fmt: skip
    key_scale = torch.tensor([1.0, 1.2, 5.0, 5.0], dtype=dtype, device=device).repeat_interleave(64)
    for tensor, first_position in ((inputs.cache[0], 0), (inputs.k_cache_before, 0), (inputs.key, cached)):
        count = min(tensor.shape[2], key_scale.numel() - first_position)
        tensor[:, :, :count] *= key_scale[first_position : first_position + count][:, None]
    out, returned = _call_with_query_lens(inputs, is_causal=True, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True)


def test_rows_per_launch_group_fits_half_of_l2():
    """Groups hold as many rows as fit in half of L2, at least one and at most all; decode (one M block) keeps
    every row in one group, where the order is the identity."""
    device = torch.device("cpu")  # the interpreter's stand-in L2
    half_l2 = triton_attention.configs.l2_bytes(device) // 2
    row_bytes = 2 * 64 * 32 * 2  # K and V of a 64-token, D 32, fp16 row
    rows_per_launch_group = triton_attention.configs.rows_per_launch_group
    assert rows_per_launch_group(1000, 3, 64, 32, 2, device) == half_l2 // row_bytes
    assert rows_per_launch_group(2, 3, 64, 32, 2, device) == 2
    assert rows_per_launch_group(1000, 3, 1 << 20, 32, 2, device) == 1
    assert rows_per_launch_group(1000, 1, 1 << 20, 32, 2, device) == 1000


@pytest.mark.parametrize(("backend", "merges_in_launch"), SPLIT_MERGE_CASES)
@pytest.mark.parametrize("num_new", [1, 4])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 100])
def test_long_cache_few_rows(
    backend, merges_in_launch, num_new, is_causal, sliding_window, split_merge_placement, device, generator
):
    """S_max 1024 with B * H_kv = 3: the shape for which the triton backend splits the cached prefix across
    programs (flash-decoding) and merges the parts; a long row, a short row with empty splits, and a row
    with no new tokens."""
    split_merge_placement(merges_in_launch)
    dtype = DTYPES[0]
    capacity = 1024
    long_len = int(torch.randint(600, capacity - num_new + 1, (1,), generator=generator))
    seq_lens, query_lens = [long_len, 5, 300], [num_new, num_new, 0]
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=4,
        num_kv_heads=1,
        num_new=num_new,
        head_dim=64,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = _call_with_query_lens(inputs, is_causal=is_causal, sliding_window=sliding_window, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal, sliding_window=sliding_window)


@pytest.mark.parametrize(("backend", "merges_in_launch"), SPLIT_MERGE_CASES)
@pytest.mark.parametrize("is_causal", [True, False])
def test_chunk_on_long_cache_one_row(backend, merges_in_launch, is_causal, split_merge_placement, device, generator):
    """40 new tokens over a long cache in a single row: on the triton backend two M tiles of packed rows, each
    split over the prefix; merged in the launch, each tile's rows are combined in several steps (MERGE_ROWS)."""
    split_merge_placement(merges_in_launch)
    dtype = DTYPES[0]
    capacity = 1024
    seq_len = int(torch.randint(500, capacity - 40 + 1, (1,), generator=generator))
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=4,
        num_kv_heads=1,
        num_new=40,
        head_dim=64,
        capacity=capacity,
        seq_lens=[seq_len],
        query_lens=[40],
    )
    out, returned = _call_with_query_lens(inputs, is_causal=is_causal, sliding_window=None, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal, sliding_window=None)


@pytest.mark.parametrize(("backend", "merges_in_launch"), SPLIT_MERGE_CASES)
def test_many_gqa_rows_head_dim_128(backend, merges_in_launch, split_merge_placement, device, generator):
    """GQA decode at D 128 with three (batch, KV head) rows per SM: the triton backend's one-warp, two-split
    config (configs.attention_config), with rows of different lengths, one of them shorter than a split."""
    split_merge_placement(merges_in_launch)
    dtype = DTYPES[0]
    num_kv_heads, capacity = 4, 160
    batch = -(-3 * num_sms(torch.device(device)) // num_kv_heads)  # three (batch, KV head) rows per SM
    if backend == "triton":
        plan = triton_attention._launch_plan(
            2, 128, batch * num_kv_heads, capacity, dtype.itemsize, torch.device(device)
        )
        assert (plan.config.num_warps, plan.num_splits) == (1, 2)
    seq_lens = [int(n) for n in torch.randint(0, capacity, (batch,), generator=generator)]
    seq_lens[0] = 40
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=2 * num_kv_heads,
        num_kv_heads=num_kv_heads,
        num_new=1,
        head_dim=128,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=[1] * batch,
    )
    out, returned = _call_with_query_lens(inputs, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_new", [1, 40])
def test_split_merge_placements_agree_bitwise(dtype, num_new, split_merge_placement, device, generator):
    """Eager calls merge a split prefix in the attention launch, CUDA-graph captured ones in a second launch.
    Both must give the same bits, or a captured decode loop picks other tokens than an eager one (a one-ulp
    difference between the two placements did that on the H100, benchmarks/NOTES.md entry 22)."""
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=4,
        num_kv_heads=1,
        num_new=num_new,
        head_dim=64,
        capacity=1024,
        seq_lens=[int(torch.randint(600, 1024 - num_new + 1, (1,), generator=generator)), 300],
        query_lens=[num_new, num_new],
    )
    outputs, caches = [], []
    for merges_in_launch in (True, False):
        split_merge_placement(merges_in_launch)
        k_cache, v_cache, seq_lens = (tensor.clone() for tensor in inputs.cache)
        out, _ = flashcore.attention_with_kv_cache(
            inputs.query, inputs.key, inputs.value, (k_cache, v_cache, seq_lens), backend="triton"
        )
        outputs.append(out)
        caches.append((k_cache, v_cache, seq_lens))
    assert torch.isfinite(outputs[0]).all()
    assert torch.equal(outputs[0], outputs[1])
    for in_launch, second_launch in zip(*caches, strict=True):
        assert torch.equal(in_launch.nan_to_num(), second_launch.nan_to_num())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_new", [1, 12])
def test_garbage_never_reaches_the_output(backend, num_new, device, generator):
    """NaN everywhere the contract says is unused: the cache past seq_lens, and the padding tokens past
    query_lens in q, k and v. Also a custom scale, so that the default is not the only one tested."""
    dtype = DTYPES[0]
    seq_lens, query_lens = [0, 19, 7], [num_new, num_new, num_new // 2]
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=4,
        num_kv_heads=2,
        num_new=num_new,
        head_dim=32,
        capacity=40,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    assert inputs.cache[0].isnan().any() and inputs.query.isnan().any()
    out, returned = _call_with_query_lens(inputs, scale=0.3, backend=backend)
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
def test_non_contiguous_inputs_and_cache(backend, num_new, strided, device, generator):
    """Any strides, one tensor class at a time: q/k/v as HF passes them, value strided unlike key, caches
    that are views into padded [B, S_max, H_kv, D + 8] buffers (writes must land in the caller's storage),
    and v_cache strided unlike k_cache. (Strided seq_lens / query_lens are rejected: tests/test_errors.py.)"""
    dtype = DTYPES[0]
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=6,
        num_kv_heads=2,
        num_new=num_new,
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
def test_backend_dispatch(backend, device, generator, kernels_run):
    """With "auto", triton runs on CUDA or under TRITON_INTERPRET=1 and torch otherwise; an explicit choice
    is kept."""
    runs_triton = device.type == "cuda" or flashcore.backends.triton_interpreter_enabled()
    expected = {"auto": "triton" if runs_triton else "torch", "torch": "torch", "triton": "triton"}[backend]
    expected = {"torch": "torch.reference", "triton": triton_attention.NAME}[expected]

    dtype = DTYPES[0]
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=2,
        num_kv_heads=1,
        num_new=3,
        head_dim=16,
        capacity=8,
        seq_lens=[2, 5],
        query_lens=[3, 3],
    )
    out, returned = flashcore.attention_with_kv_cache(
        inputs.query, inputs.key, inputs.value, inputs.cache, backend=backend
    )
    assert kernels_run == [expected]
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True)


def test_auto_picks_torch_without_interpreter(monkeypatch, generator, kernels_run):
    """On CPU tensors without TRITON_INTERPRET=1, "auto" is the torch backend and it works."""
    monkeypatch.setattr(flashcore.backends, "triton_interpreter_enabled", lambda: False)
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=torch.float32,
        device="cpu",
        num_q_heads=3,
        num_kv_heads=3,
        num_new=2,
        head_dim=8,
        capacity=6,
        seq_lens=[4],
        query_lens=[2],
    )
    out, returned = flashcore.attention_with_kv_cache(inputs.query, inputs.key, inputs.value, inputs.cache)
    assert kernels_run == ["torch.reference"]
    check_call(inputs, out, returned, atol=TOLERANCES[torch.float32], is_causal=True)
