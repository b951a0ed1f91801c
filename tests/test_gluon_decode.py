"""The Gluon sm_90 warp-specialised decode kernel: which calls ops hands it, and the contract on those calls.

It runs on sm_90 GPUs only (Gluon, TMA and mbarriers have no interpreter), so everything but the first test
needs the H100. The contract cases call it directly; one test checks that ops hands it eligible calls, eager
and captured alike, with the same bits. The cases aim at its own edges: empty and one-tile prefixes, tails of
1 and 63 keys, rows filled to the last slot, every split count from one to many, GQA groups from 1 to 16.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from conftest import ON_GPU, TOLERANCES, randn
from oracle import check_call, make_call_inputs, with_heads_interleaved_caches

import flashcore
from flashcore.backends import kernels_as_captured
from flashcore.kernels import KernelCall, configs, launch
from flashcore.kernels.gluon_sm90 import common as gluon_common
from flashcore.kernels.gluon_sm90 import decode as gluon_decode
from flashcore.kernels.triton import split_merge

ON_HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9 and gluon_common.HAS_GLUON
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="the Gluon decode kernel runs on sm_90 GPUs only")
LOW_PRECISION = [torch.float16, torch.bfloat16]


def _decode_inputs(
    generator, device, dtype, *, heads=(32, 8), head_dim=128, seq_lens=(100,), capacity=None, query_lens=None
):
    num_q_heads, num_kv_heads = heads
    return make_call_inputs(
        randn, generator=generator, dtype=dtype, device=device, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, num_new=1, head_dim=head_dim, capacity=capacity or max(seq_lens) + 8,
        seq_lens=list(seq_lens), query_lens=list(query_lens or [1] * len(seq_lens)),
    )  # fmt: skip


def _supports(inputs, query_lens=None, sliding_window=0, k_cache=None):
    k_cache = inputs.cache[0] if k_cache is None else k_cache
    call = KernelCall(inputs.query, inputs.key, inputs.value, k_cache, inputs.cache[1], inputs.cache[2], query_lens,
                      True, 1.0, sliding_window)  # fmt: skip
    return gluon_decode.supports(call)


def _decode(inputs, query_lens=None):
    """The kernel on one call's inputs, as ops would run it (scale 1 / sqrt(D))."""
    k_cache, v_cache, seq_lens = inputs.cache
    scale = inputs.query.shape[-1] ** -0.5
    out = gluon_decode.run(
        KernelCall(inputs.query, inputs.key, inputs.value, k_cache, v_cache, seq_lens, query_lens, True, scale, 0)
    )
    return out, inputs.cache


def test_supports_only_the_decode_calls_it_was_built_for(device, generator):
    inputs = _decode_inputs(generator, device, torch.float16)
    assert _supports(inputs) == ON_HOPPER  # a CPU tensor, or the interpreter: never
    if not ON_HOPPER:
        return
    one_token = torch.ones(1, dtype=torch.int32, device=device)
    assert _supports(inputs, query_lens=one_token)  # HF passes query_lens whenever it passes a padding mask
    assert not _supports(inputs, sliding_window=16)
    assert not _supports(_decode_inputs(generator, device, torch.float32))
    assert not _supports(_decode_inputs(generator, device, torch.float16, head_dim=80))
    assert not _supports(_decode_inputs(generator, device, torch.float16, heads=(32, 1)))  # a group of 32
    assert _supports(with_heads_interleaved_caches(inputs))
    assert not _supports(inputs, k_cache=with_heads_interleaved_caches(inputs).cache[0])  # K and V laid out differently
    k_cache = inputs.cache[0]
    padded_rows = torch.empty(*k_cache.shape[:-1], k_cache.shape[-1] + 8, dtype=k_cache.dtype, device=device)
    assert not _supports(inputs, k_cache=padded_rows[..., :-8])
    chunk = make_call_inputs(
        randn, generator=generator, dtype=torch.float16, device=device, num_q_heads=32, num_kv_heads=8,
        num_new=2, head_dim=128, capacity=64, seq_lens=[10], query_lens=[2],
    )  # fmt: skip
    assert not _supports(chunk)


@hopper_only
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize(
    "heads, head_dim", [((32, 8), 128), ((9, 3), 64), ((32, 32), 128), ((16, 1), 64)], ids=["gqa", "smol", "mha", "mqa"]
)
@pytest.mark.parametrize(
    "seq_lens",
    [[0, 1, 63, 64, 65], [4000, 129, 7], [2048]],
    ids=["short_tails", "long_and_short", "one_long_row"],
)
def test_decode_matches_oracle(dtype, heads, head_dim, seq_lens, device, generator):
    inputs = _decode_inputs(generator, device, dtype, heads=heads, head_dim=head_dim, seq_lens=seq_lens)
    assert _supports(inputs)
    out, cache = _decode(inputs)
    check_call(inputs, out, cache, atol=TOLERANCES[dtype], is_causal=True)


@hopper_only
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("heads, head_dim", [((32, 8), 128), ((9, 3), 64), ((32, 32), 128)], ids=["gqa", "smol", "mha"])
@pytest.mark.parametrize(
    "seq_lens", [[0, 1, 63, 64, 65], [4000, 129, 7], [60] * 32], ids=["short_tails", "long_and_short", "B32"]
)
def test_decode_matches_oracle_on_heads_interleaved_caches(dtype, heads, head_dim, seq_lens, device, generator):
    """Caches whose tokens keep their heads together: the TMA tiles walk a [B * S_max, H_kv * D] view, and the
    new token's K/V lands through the caches' own strides."""
    inputs = with_heads_interleaved_caches(
        _decode_inputs(generator, device, dtype, heads=heads, head_dim=head_dim, seq_lens=seq_lens)
    )
    assert _supports(inputs)
    out, cache = _decode(inputs)
    check_call(inputs, out, cache, atol=TOLERANCES[dtype], is_causal=True)


@hopper_only
@pytest.mark.parametrize("batch", [1, 8, 64], ids=lambda b: f"B{b}")
def test_split_counts_from_many_to_one(batch, device, generator):
    """B1 splits the prefix over many programs (their last merges them in the launch, as an eager call does);
    B64 runs one program per (batch, KV head) row, whose last program advances seq_lens through the row ticket."""
    seq_lens = torch.randint(1, 3000, (batch,), generator=generator).tolist()
    inputs = _decode_inputs(generator, device, torch.bfloat16, seq_lens=seq_lens, capacity=3008)
    out, cache = _decode(inputs)
    check_call(inputs, out, cache, atol=TOLERANCES[torch.bfloat16], is_causal=True)


def test_launch_plan_splits_and_tiles(monkeypatch):
    """The plan for the H100's 132 SMs (host code, on any machine): one wave of splits where the rows' programs
    fill at most half the SMs; two splits where they fill more than half but not all (two programs to most SMs);
    one split from a full wave on. 128-key tiles at D 64 where the programs, before splitting, are at most one an
    SM and every split keeps its length; 64-key tiles at D 128."""
    monkeypatch.setattr(configs, "num_sms", lambda device: 132)
    gluon_decode.forget_launch_plans()  # plans are cached per shape: none made with the real count
    try:
        cpu = torch.device("cpu")
        plans = {
            (programs, head_dim): gluon_decode._launch_plan(programs, 1280, 4, head_dim, cpu)[:2]
            for programs in (8, 64, 66, 67, 128, 132, 133, 192)
            for head_dim in (64, 128)
        }
        for head_dim, block_n in ((64, 128), (128, 64)):
            assert plans[8, head_dim] == (block_n, 16)
            assert plans[64, head_dim] == (block_n, 2)
            assert plans[66, head_dim] == (block_n, 2)
            assert plans[67, head_dim] == (block_n, 2)
            assert plans[128, head_dim] == (block_n, 2)
            assert plans[132, head_dim] == (block_n, 2)
            assert plans[133, head_dim] == (64, 1)
            assert plans[192, head_dim] == (64, 1)
    finally:
        gluon_decode.forget_launch_plans()


@hopper_only
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize(
    "seq_lens, capacity, block_n, splits",
    [
        ([1279], 1280, 64, 20),
        ([4351, 127], 4352, 128, 22),
        ([1, 2049], 4352, 128, 22),
        ([1279, 1, 640, 127] * 8, 1280, 128, 2),
        ([1279, 1, 640, 127] * 12, 1280, 64, 1),
    ],
    ids=[
        "splits_of_64_keys", "128_key_tiles_full_row", "128_key_tiles_tails", "two_splits_two_an_sm",
        "one_split_full_wave",
    ],
)  # fmt: skip
def test_head_dim_64_tile_sizes(seq_lens, capacity, block_n, splits, dtype, device, generator, monkeypatch):
    """At D 64 the kernel streams 128-key tiles where one wave holds at most one program per SM before splitting
    and every split keeps its length (configs.gluon_decode_block_n), 64-key tiles elsewhere; two splits where one
    leaves SMs empty but fills more than half (configs.gluon_decode_kv_splits): each against the oracle, with tails
    of 1 and 127 keys and a row filled to the last slot. Planned for the H100's 132 SMs on any GPU."""
    monkeypatch.setattr(configs, "num_sms", lambda device: 132)
    gluon_decode.forget_launch_plans()  # plans are cached per shape: none made with the real count
    try:
        inputs = _decode_inputs(generator, device, dtype, heads=(9, 3), head_dim=64, seq_lens=seq_lens,
                                capacity=capacity)  # fmt: skip
        plan = gluon_decode._launch_plan(len(seq_lens) * 3, capacity, 3, 64, device)
        assert plan[:2] == (block_n, splits)
        out, cache = _decode(inputs)
        check_call(inputs, out, cache, atol=TOLERANCES[dtype], is_causal=True)
    finally:
        gluon_decode.forget_launch_plans()


@hopper_only
def test_row_filled_to_the_last_slot(device, generator):
    """The new token lands in slot S_max - 1, and a tail copy of the prefix reaches the end of the cache."""
    inputs = _decode_inputs(generator, device, torch.float16, seq_lens=[191, 100], capacity=192)
    out, cache = _decode(inputs)
    check_call(inputs, out, cache, atol=TOLERANCES[torch.float16], is_causal=True)


@hopper_only
@pytest.mark.parametrize("seq_len", [40, 3000], ids=["one_split", "split"])
def test_padding_rows_store_nothing_and_output_zero(seq_len, device, generator):
    """query_lens 0 marks a row's token as padding (NaN here): nothing appended, seq_lens unchanged, output 0;
    the other rows are unaffected. HF's generate passes query_lens at every decode step (its mask)."""
    query_lens = [1, 0, 1, 0]
    inputs = _decode_inputs(generator, device, torch.bfloat16, seq_lens=[seq_len, seq_len - 7, 5, 0],
                            capacity=seq_len + 8, query_lens=query_lens)  # fmt: skip
    lens = torch.tensor(query_lens, dtype=torch.int32, device=device)
    out, cache = _decode(inputs, query_lens=lens)
    check_call(inputs, out, cache, atol=TOLERANCES[torch.bfloat16], is_causal=True)


@hopper_only
@pytest.mark.parametrize("with_query_lens", [False, True], ids=["no_query_lens", "query_lens"])
@pytest.mark.parametrize("seq_lens", [[1500], [700, 3, 0, 1200]], ids=["B1_split", "B4"])
def test_eager_steps_on_one_cache_replay_the_bound_launch(seq_lens, with_query_lens, device, generator, monkeypatch):
    """A decode loop on one cache, as generate runs it: the first eager call binds its launch, later ones launch it
    again with their own q/k/v, query_lens and output addresses. Every step against the oracle; one step's q/k/v
    are misaligned, which the bound launch declines (Triton specialises on alignment), so the normal launch runs."""
    gluon_decode.forget_launch_plans()  # a bound launch left by another test could hold this cache's address
    outcomes = []
    bound_launch = launch.BoundLaunch.launch
    monkeypatch.setattr(
        launch.BoundLaunch, "launch", lambda self, *a: outcomes.append(bound_launch(self, *a)) or outcomes[-1]
    )
    inputs = _decode_inputs(generator, device, torch.bfloat16, heads=(9, 3), head_dim=64, seq_lens=seq_lens,
                            capacity=max(seq_lens) + 8)  # fmt: skip
    for step in range(5):
        if step:
            new = (
                randn(tensor.shape, generator=generator, dtype=tensor.dtype, device=device)
                for tensor in (inputs.query, inputs.key, inputs.value)
            )
            inputs = dataclasses.replace(
                inputs, query=next(new), key=next(new), value=next(new), seq_lens=[n + 1 for n in inputs.seq_lens],
                k_cache_before=inputs.cache[0].clone(), v_cache_before=inputs.cache[1].clone(),
            )  # fmt: skip
        if step == 2:
            inputs.query, inputs.key, inputs.value = (_misaligned(t) for t in (inputs.query, inputs.key, inputs.value))
        query_lens = torch.ones(len(seq_lens), dtype=torch.int32, device=device) if with_query_lens else None
        out, cache = _decode(inputs, query_lens=query_lens)
        check_call(inputs, out, cache, atol=TOLERANCES[torch.bfloat16], is_causal=True)
    assert outcomes == [True, False, True, True]


def _misaligned(tensor: torch.Tensor) -> torch.Tensor:
    """The same values in storage that starts 2 bytes past a 16-byte boundary."""
    storage = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
    return storage[1:].view(tensor.shape).copy_(tensor)


@hopper_only
@pytest.mark.parametrize(
    "heads, head_dim, capacity",
    [((32, 8), 128, 1100), ((9, 3), 64, 4100), ((32, 32), 128, 4100), ((16, 1), 128, 1100)],
    ids=["gqa", "smol", "mha", "group_16"],
)
def test_split_merge_placements_agree_bitwise(heads, head_dim, capacity, device, generator, monkeypatch):
    """Eager calls merge the splits in this kernel's launch (its Gluon copy of the merge), captured ones in
    the Triton merge launch. Both must give the same bits, or a graph-replayed decode loop picks other tokens
    than an eager one (test_contract_tiling.py's test of the same name, for the Triton kernel)."""
    seq_lens = [int(torch.randint(capacity // 2, capacity - 8, (1,), generator=generator)), 0, 70]
    inputs = _decode_inputs(generator, device, torch.bfloat16, heads=heads, head_dim=head_dim, seq_lens=seq_lens,
                            capacity=capacity)  # fmt: skip
    outputs, caches = [], []
    for merges_in_launch in (True, False):
        placement = functools.partial(lambda placed, device: placed, merges_in_launch)
        monkeypatch.setattr(split_merge, "merges_in_attention_launch", placement)
        call = dataclasses.replace(inputs, cache=tuple(tensor.clone() for tensor in inputs.cache))
        out, cache = _decode(call)
        check_call(call, out, cache, atol=TOLERANCES[torch.bfloat16], is_causal=True)
        outputs.append(out)
        caches.append(cache)
    assert torch.equal(outputs[0], outputs[1])
    for in_launch, second_launch in zip(*caches, strict=True):
        assert torch.equal(in_launch.nan_to_num(), second_launch.nan_to_num())


@hopper_only
@pytest.mark.parametrize("with_query_lens", [False, True], ids=["no_query_lens", "query_lens"])
@pytest.mark.parametrize("batch", [1, 64], ids=["split", "one_program_per_row"])
def test_ops_runs_it_eagerly_and_captured_with_the_same_bits(batch, with_query_lens, device, generator, kernels_run):
    """ops hands a decode call to this kernel whether it runs eagerly or is captured into a CUDA graph, so a
    replayed step writes the eager step's bits: output, cache and seq_lens. With query_lens too, which HF's
    generate passes at every step."""
    seq_lens = torch.randint(500, 1500, (batch,), generator=generator).tolist()
    inputs = _decode_inputs(generator, device, torch.bfloat16, seq_lens=seq_lens, capacity=1600)
    k_cache, v_cache, lens = inputs.cache
    lens_before = lens.clone()
    query_lens = torch.ones(batch, dtype=torch.int32, device=device) if with_query_lens else None
    eager, _ = flashcore.attention_with_kv_cache(
        inputs.query, inputs.key, inputs.value, inputs.cache, query_lens=query_lens
    )
    check_call(inputs, eager, inputs.cache, atol=TOLERANCES[torch.bfloat16], is_causal=True)
    assert kernels_run == [gluon_decode.NAME]
    eager_cache = (k_cache.clone(), v_cache.clone(), lens.clone())

    # Each call below appends the same token to the same slot. The first, eager in kernels_as_captured(), compiles
    # the variant the capture runs (the merge in a launch of its own), as DecodeSession's warm-up does: a capture
    # that met that variant first, with no earlier test of its process having loaded it, failed.
    lens.copy_(lens_before)
    with kernels_as_captured():
        flashcore.attention_with_kv_cache(inputs.query, inputs.key, inputs.value, inputs.cache, query_lens=query_lens)
    lens.copy_(lens_before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed, _ = flashcore.attention_with_kv_cache(
            inputs.query, inputs.key, inputs.value, inputs.cache, query_lens=query_lens
        )
    assert kernels_run == [gluon_decode.NAME] * 3
    lens.copy_(lens_before)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
    for replayed_part, eager_part in zip(inputs.cache, eager_cache, strict=True):
        assert torch.equal(replayed_part.nan_to_num(), eager_part.nan_to_num())


@hopper_only
@pytest.mark.parametrize("heads, head_dim", [((9, 3), 64), ((32, 8), 128)], ids=["smol", "gqa"])
def test_calls_back_to_back_on_one_cache_captured(heads, head_dim, device, generator, kernels_run):
    """Calls on one cache with nothing between them, captured into one CUDA graph: decode, decode, a 3-token call
    (a prefill kernel), decode, decode, each with its prefix split and merged in a second launch. Under
    programmatic dependent launch each attention launch starts while the merge before it runs, and this kernel
    reads seq_lens and the cached prefix before its wait; it must see the call before it complete. The replay gives
    the eager calls' bits, and each eager call is checked against the fp64 oracle."""
    num_new = [1, 1, 3, 1, 1]
    seq_len = int(torch.randint(1000, 1400, (1,), generator=generator))
    capacity = seq_len + sum(num_new) + 8
    num_q_heads, num_kv_heads = heads
    first = make_call_inputs(
        randn, generator=generator, dtype=torch.bfloat16, device=device, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, num_new=1, head_dim=head_dim, capacity=capacity, seq_lens=[seq_len],
        query_lens=[1],
    )  # fmt: skip
    cache_before = tuple(tensor.clone() for tensor in first.cache)
    qkv = [
        tuple(
            randn((1, heads_, n, head_dim), generator=generator, dtype=torch.bfloat16, device=device)
            for heads_ in (num_q_heads, num_kv_heads, num_kv_heads)
        )
        for n in num_new
    ]
    eager = []
    for step, (query, key, value) in enumerate(qkv):
        inputs = dataclasses.replace(
            first, query=query, key=key, value=value, seq_lens=[seq_len + sum(num_new[:step])],
            query_lens=[num_new[step]], k_cache_before=first.cache[0].clone(), v_cache_before=first.cache[1].clone(),
        )  # fmt: skip
        out, cache = flashcore.attention_with_kv_cache(query, key, value, inputs.cache)
        check_call(inputs, out, cache, atol=TOLERANCES[torch.bfloat16], is_causal=True)
        eager.append(out)
    assert kernels_run[:2] == kernels_run[3:] == [gluon_decode.NAME] * 2  # the 3-token call: a prefill kernel
    eager_cache = tuple(tensor.clone() for tensor in first.cache)

    def restore():
        for tensor, before in zip(first.cache, cache_before, strict=True):
            tensor.copy_(before)

    restore()
    with kernels_as_captured():  # compiles what the capture runs (see the test above)
        for query, key, value in qkv:
            flashcore.attention_with_kv_cache(query, key, value, first.cache)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = [flashcore.attention_with_kv_cache(query, key, value, first.cache)[0] for query, key, value in qkv]
    restore()
    graph.replay()
    torch.cuda.synchronize()
    for replayed_out, eager_out in zip(replayed, eager, strict=True):
        assert torch.equal(replayed_out, eager_out)
    for replayed_part, eager_part in zip(first.cache, eager_cache, strict=True):
        assert torch.equal(replayed_part.nan_to_num(), eager_part.nan_to_num())
