"""The contract of ``flashcore.attention_with_kv_cache`` at the edges of the triton kernel's tiling.

The new tokens as one tile or a loop; the largest tiles; long prefills across tile edges; the launch order's
row groups; a running row max that jumps between key tiles; the cached prefix split across programs
(flash-decoding) and merged in the attention launch or in a second one. Every call is checked against the
fp64 oracle by :func:`oracle.check_call`, as in test_contract.py.
"""

from __future__ import annotations

import pytest
import torch
from cases import BACKENDS, TORCH_REFERENCE, TORCH_SDPA, call_with_query_lens, inputs_maker
from conftest import DTYPES, TOLERANCES
from oracle import check_call

import flashcore
from flashcore.kernels.configs import NEW_TOKENS_TILE, num_sms
from flashcore.kernels.triton import attention as triton_attention
from flashcore.kernels.triton import split_merge

# The triton backend merges a split prefix either in the attention launch (eager) or in a second launch
# (under CUDA-graph capture); the split-KV tests force each placement so that both run on every device.
SPLIT_MERGE_CASES = [
    pytest.param(*TORCH_SDPA.values, None, marks=TORCH_SDPA.marks, id=TORCH_SDPA.id),
    pytest.param(*TORCH_REFERENCE.values, None, marks=TORCH_REFERENCE.marks, id=TORCH_REFERENCE.id),
    pytest.param("triton", True, id="triton-merge_in_launch"),
    pytest.param("triton", False, id="triton-merge_second_launch"),
]


@pytest.fixture
def make_inputs(generator, device):
    """Builds a call's inputs (:func:`cases.inputs_maker`): fresh N(0, 1) data from this test's generator."""
    return inputs_maker(generator, device)


@pytest.fixture
def split_merge_placement(monkeypatch):
    """Call with True/False to force where the triton backend merges split partials (None: leave the policy)."""

    def force(merges_in_launch: bool | None) -> None:
        if merges_in_launch is not None:
            monkeypatch.setattr(split_merge, "merges_in_attention_launch", lambda device: merges_in_launch)

    return force


@pytest.mark.parametrize("num_new", [NEW_TOKENS_TILE, NEW_TOKENS_TILE + 1])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_new_tokens_one_tile_or_loop(num_new, is_causal, sliding_window, generator, make_inputs):
    """Both ways the triton kernel attends to the new tokens: as one tile loaded before the cached prefix
    (at most NEW_TOKENS_TILE of them) and through the tiled loop (one more), with rows of fewer valid new
    tokens, an empty cache, a window edge among the new tokens and one in the cache. GQA 16/2 packs 128 rows at
    NEW_TOKENS_TILE tokens: the prefill-sized M tile meets the one-tile path."""
    dtype = DTYPES[-1]
    capacity = num_new + 90
    seq_lens = [int(torch.randint(20, 90, (1,), generator=generator)), 0, 90]
    query_lens = [num_new, 3, num_new - 5]
    inputs = make_inputs(
        dtype=dtype,
        num_q_heads=16,
        num_kv_heads=2,
        head_dim=64,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = call_with_query_lens(inputs, is_causal=is_causal, sliding_window=sliding_window, backend="triton")
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
def test_largest_tiles_fit_and_match(dtype, head_dim, group, num_new, generator, make_inputs):
    """Each launch config at its largest shared-memory footprint: the widest row (fp32, head dim up to 256) with
    the most packed rows of its M tile, with and without the new tokens' one-tile load. On the GPU a config that
    needs more shared memory than the SM has fails to launch (the fuzz test found one, fp32 at head dim 252:
    NOTES.md entry 28); everywhere, the output must still match the oracle."""
    capacity = num_new + 70
    seq_lens = [int(torch.randint(1, 71, (1,), generator=generator)), 0]
    inputs = make_inputs(
        dtype=dtype,
        num_q_heads=group,
        num_kv_heads=1,
        head_dim=head_dim,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=[num_new, num_new - 3],
    )
    out, returned = call_with_query_lens(inputs, is_causal=True, backend="triton")
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True, sliding_window=None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [59, 256])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_long_prefill(backend, head_dim, is_causal, sliding_window, generator, make_inputs):
    """70 new tokens over GQA 2/1: enough packed rows for the large prefill tiles, several key tiles of new
    tokens, a diagonal that crosses tile edges, and a window edge inside the new tokens."""
    dtype = DTYPES[-1]
    seq_lens, query_lens = [0, int(torch.randint(1, 40, (1,), generator=generator))], [70, 53]
    inputs = make_inputs(
        dtype=dtype,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        capacity=120,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = call_with_query_lens(inputs, is_causal=is_causal, sliding_window=sliding_window, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal, sliding_window=sliding_window)


@pytest.mark.parametrize("rows_per_group", [1, 2, 3, 4])
def test_launch_order_groups(rows_per_group, monkeypatch, device, generator, make_inputs):
    """Prefill of 3 M blocks over 4 (batch, KV head) rows, the launch order grouping 1, 2, 3 or all 4 rows (with
    3, the last group short; configs.rows_per_launch_group picks the size from L2): every (row, M block) program
    runs once, so each output matches the oracle and seq_lens advances exactly once."""
    monkeypatch.setattr(triton_attention.configs, "rows_per_launch_group", lambda *shape: rows_per_group)
    triton_attention._launch_plan.cache_clear()
    try:
        dtype = DTYPES[-1]
        inputs = make_inputs(
            dtype=dtype,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=32,
            capacity=200,
            seq_lens=[int(n) for n in torch.randint(0, 41, (2,), generator=generator)],
            query_lens=[160, 97],  # S_q 160, 320 packed rows: 3 M blocks of 128
        )
        plan = triton_attention._launch_plan(320, 32, 4, 200, dtype.itemsize, torch.device(device))
        assert (plan.num_m_blocks, plan.rows_per_group) == (3, rows_per_group)
        out, returned = call_with_query_lens(inputs, is_causal=True, backend="triton")
        check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True)
    finally:
        triton_attention._launch_plan.cache_clear()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_new", "cached"), [(150, 0), (40, 150), (1, 190)])
def test_row_max_jumps_between_key_tiles(backend, num_new, cached, device, make_inputs):
    """Keys whose scale jumps between 64-key tiles (x1, x1.2, x5, x5 by position), so the online softmax's running
    row max grows a little, then a lot (keys x5: scores of standard deviation ~5), then not at all, across the
    cached prefix and the new tokens: prefill (128-row M blocks), a chunk on a cache, and decode."""
    dtype = DTYPES[-1]
    inputs = make_inputs(
        dtype=dtype, num_q_heads=4, num_kv_heads=2, head_dim=32, capacity=200, seq_lens=[cached], query_lens=[num_new]
    )
    key_scale = torch.tensor([1.0, 1.2, 5.0, 5.0], dtype=dtype, device=device).repeat_interleave(64)
    for tensor, first_position in ((inputs.cache[0], 0), (inputs.k_cache_before, 0), (inputs.key, cached)):
        count = min(tensor.shape[2], key_scale.numel() - first_position)
        tensor[:, :, :count] *= key_scale[first_position : first_position + count][:, None]
    out, returned = call_with_query_lens(inputs, is_causal=True, backend=backend)
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
    backend, merges_in_launch, num_new, is_causal, sliding_window, split_merge_placement, generator, make_inputs
):
    """S_max 1024 with B * H_kv = 3: the shape for which the triton backend splits the cached prefix across
    programs (flash-decoding) and merges the parts; a long row, a short row with empty splits, and a row
    with no new tokens."""
    split_merge_placement(merges_in_launch)
    dtype = DTYPES[0]
    capacity = 1024
    long_len = int(torch.randint(600, capacity - num_new + 1, (1,), generator=generator))
    seq_lens, query_lens = [long_len, 5, 300], [num_new, num_new, 0]
    inputs = make_inputs(
        dtype=dtype,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )
    out, returned = call_with_query_lens(inputs, is_causal=is_causal, sliding_window=sliding_window, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal, sliding_window=sliding_window)


@pytest.mark.parametrize(("backend", "merges_in_launch"), SPLIT_MERGE_CASES)
@pytest.mark.parametrize("is_causal", [True, False])
def test_chunk_on_long_cache_one_row(
    backend, merges_in_launch, is_causal, split_merge_placement, generator, make_inputs
):
    """40 new tokens over a long cache in a single row: on the triton backend two M tiles of packed rows, each
    split over the prefix; merged in the launch, each tile's rows are combined in several steps (MERGE_ROWS)."""
    split_merge_placement(merges_in_launch)
    dtype = DTYPES[0]
    capacity = 1024
    seq_len = int(torch.randint(500, capacity - 40 + 1, (1,), generator=generator))
    inputs = make_inputs(
        dtype=dtype, num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=capacity, seq_lens=[seq_len], query_lens=[40]
    )
    out, returned = call_with_query_lens(inputs, is_causal=is_causal, sliding_window=None, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=is_causal, sliding_window=None)


@pytest.mark.parametrize(("backend", "merges_in_launch"), SPLIT_MERGE_CASES)
def test_many_gqa_rows_head_dim_128(backend, merges_in_launch, split_merge_placement, device, generator, make_inputs):
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
    inputs = make_inputs(
        dtype=dtype,
        num_q_heads=2 * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=128,
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=[1] * batch,
    )
    out, returned = call_with_query_lens(inputs, backend=backend)
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_new", [1, 40])
def test_split_merge_placements_agree_bitwise(dtype, num_new, split_merge_placement, generator, make_inputs):
    """Eager calls merge a split prefix in the attention launch, CUDA-graph captured ones in a second launch.
    Both must give the same bits, or a captured decode loop picks other tokens than an eager one (a one-ulp
    difference between the two placements did that on the H100, benchmarks/NOTES.md entry 22)."""
    inputs = make_inputs(
        dtype=dtype,
        num_q_heads=4,
        num_kv_heads=1,
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


def test_a_merge_launch_remembers_its_cache(split_merge_placement, generator, make_inputs):
    """The merge launch releases the next kernel before it waits for the attention launch, so the next attention
    launch on the same cache must not read that cache before its own wait: ``split_merge.follows_merge_of`` says
    which cache's launch the last merge followed (a split decode on each of two caches, merged in a second launch)."""
    split_merge_placement(False)
    caches = []
    for _ in range(2):
        inputs = make_inputs(
            dtype=DTYPES[0], num_q_heads=4, num_kv_heads=1, head_dim=64, capacity=1024, seq_lens=[700, 300],
            query_lens=[1, 1],
        )  # fmt: skip
        caches.append(inputs)
    for merged, other in ((0, 1), (1, 0)):
        inputs = caches[merged]
        plan = triton_attention._launch_plan(4, 64, 2, 1024, inputs.cache[0].element_size(), inputs.query.device)
        assert plan.num_splits > 1  # the shape must split, or no merge launch runs
        out, returned = call_with_query_lens(inputs, is_causal=True, backend="triton")
        check_call(inputs, out, returned, atol=TOLERANCES[DTYPES[0]], is_causal=True)
        assert split_merge.follows_merge_of(inputs.cache[2])
        assert not split_merge.follows_merge_of(caches[other].cache[2])
