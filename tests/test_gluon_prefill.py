"""The Gluon sm_90 warp-specialised prefill kernel: which calls ops hands it, and the contract on those calls.

It runs on sm_90 GPUs only (Gluon, TMA, wgmma and mbarriers have no interpreter), so everything but the first
test needs the H100. ops hands it causal chunks of at least 128 new tokens (no query_lens, no window, D 64 or
128), eager or captured. The cases aim at its own edges: an empty cache and cached prefixes that end inside a key
tile (the tail copy reads garbage, maybe NaN), chunks that end inside a query block, rows with different prefixes, a
chunk that fills the cache to its last slot, and GQA groups 1 and 4.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ON_GPU, TOLERANCES, randn
from oracle import check_call, make_call_inputs, with_heads_interleaved_caches

import flashcore
from flashcore import ops
from flashcore.kernels import KernelCall
from flashcore.kernels.gluon_sm90 import common as gluon_common
from flashcore.kernels.gluon_sm90 import prefill as gluon_prefill

ON_HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9 and gluon_common.HAS_GLUON
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="the Gluon prefill kernel runs on sm_90 GPUs only")


def _chunk_inputs(generator, device, dtype, *, seq_lens, num_new, heads=(32, 8), capacity=None, head_dim=128):
    num_q_heads, num_kv_heads = heads
    return make_call_inputs(
        randn, generator=generator, dtype=dtype, device=device, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, num_new=num_new, head_dim=head_dim,
        capacity=capacity or max(seq_lens) + num_new + 8, seq_lens=list(seq_lens),
        query_lens=[num_new] * len(seq_lens),
    )  # fmt: skip


def _supports(inputs, query_lens=None, is_causal=True, sliding_window=0):
    k_cache, v_cache, seq_lens = inputs.cache
    return gluon_prefill.supports(
        KernelCall(
            inputs.query,
            inputs.key,
            inputs.value,
            k_cache,
            v_cache,
            seq_lens,
            query_lens,
            is_causal,
            1.0,
            sliding_window,
        )  # fmt: skip
    )


def test_supports_only_the_chunks_it_was_built_for(device, generator):
    inputs = _chunk_inputs(generator, device, torch.float16, seq_lens=[0], num_new=128)
    assert _supports(inputs) == ON_HOPPER  # a CPU tensor, or the interpreter: never
    if not ON_HOPPER:
        return
    all_new = torch.full((1,), 128, dtype=torch.int32, device=device)
    assert not _supports(inputs, query_lens=all_new)
    assert not _supports(inputs, is_causal=False)
    assert not _supports(inputs, sliding_window=64)
    assert not _supports(_chunk_inputs(generator, device, torch.float16, seq_lens=[0], num_new=127))
    assert not _supports(_chunk_inputs(generator, device, torch.float32, seq_lens=[0], num_new=128))
    assert not _supports(_chunk_inputs(generator, device, torch.float16, seq_lens=[0], num_new=128, head_dim=80))
    assert _supports(_chunk_inputs(generator, device, torch.float16, seq_lens=[0], num_new=128, head_dim=64))
    assert _supports(with_heads_interleaved_caches(inputs))  # allocate_kv_cache's layout


@hopper_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa", "mha"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "seq_lens, num_new",
    [([0], 1024), ([0, 0], 200), ([1, 127], 128), ([100, 1000], 513), ([256], 300)],
    ids=["prefill", "ragged_block", "short_prefixes", "prefixes_inside_tiles", "tile_aligned_prefix"],
)
@pytest.mark.parametrize("layout", ["contiguous", "heads_interleaved"])
def test_chunk_matches_oracle(layout, dtype, heads, head_dim, seq_lens, num_new, device, generator, kernels_run):
    """Through the public op, which must hand these calls to the Gluon kernel (and not to the Triton one), on
    contiguous caches and on allocate_kv_cache's layout (each token's heads together)."""
    inputs = _chunk_inputs(generator, device, dtype, seq_lens=seq_lens, num_new=num_new, heads=heads, head_dim=head_dim)
    if layout == "heads_interleaved":
        inputs = with_heads_interleaved_caches(inputs)
    assert _supports(inputs)
    out, cache = flashcore.attention_with_kv_cache(inputs.query, inputs.key, inputs.value, inputs.cache)
    assert kernels_run == [gluon_prefill.NAME]
    check_call(inputs, out, cache, atol=TOLERANCES[dtype], is_causal=True)


@hopper_only
def test_chunk_fills_the_cache_to_the_last_slot(device, generator):
    inputs = _chunk_inputs(generator, device, torch.bfloat16, seq_lens=[70, 3], num_new=130, capacity=200)
    out, cache = flashcore.attention_with_kv_cache(inputs.query, inputs.key, inputs.value, inputs.cache)
    check_call(inputs, out, cache, atol=TOLERANCES[torch.bfloat16], is_causal=True)


@hopper_only
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa", "mha"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunk_writes_a_token_major_output_to_the_same_bits(heads, head_dim, device, generator):
    """``AttentionPlan.run(out=...)`` with a token-major ``out`` (what a model's o projection reads, no copy between
    them): the same bits as the kernel's own contiguous output, on a copy of the same cache, and the contract."""
    inputs = _chunk_inputs(generator, device, torch.bfloat16, seq_lens=[0, 70], num_new=300, heads=heads,
                           head_dim=head_dim)  # fmt: skip
    query, key, value = inputs.query, inputs.key, inputs.value
    plan = ops.AttentionPlan(query, key, value, inputs.cache)
    assert plan.kernel is gluon_prefill and plan.takes_out
    contiguous = plan.run(query, key, value, tuple(t.clone() for t in inputs.cache))
    batch, num_heads, num_new, _ = query.shape
    out = torch.full((batch, num_new, num_heads, head_dim), float("nan"), dtype=query.dtype, device=device)
    returned = plan.run(query, key, value, inputs.cache, out=out.transpose(1, 2))
    assert returned.data_ptr() == out.data_ptr() and returned.transpose(1, 2).is_contiguous()
    assert torch.equal(returned, contiguous)
    check_call(inputs, returned, inputs.cache, atol=TOLERANCES[torch.bfloat16], is_causal=True)
    with pytest.raises(ValueError, match="unit stride along D"):
        d_major = torch.empty(batch, head_dim, num_heads, num_new, dtype=query.dtype, device=device)
        plan.run(query, key, value, inputs.cache, out=d_major.permute(0, 2, 3, 1))


def test_a_plan_whose_kernel_writes_its_own_output_refuses_out(device, generator):
    """A decode call's kernel (and every kernel on the CPU) allocates its output: ``out`` gets a clear error."""
    inputs = _chunk_inputs(generator, device, torch.float32, seq_lens=[3], num_new=1, heads=(4, 2), head_dim=16)
    plan = ops.AttentionPlan(inputs.query, inputs.key, inputs.value, inputs.cache)
    assert not plan.takes_out
    with pytest.raises(ValueError, match="pass out=None"):
        plan.run(inputs.query, inputs.key, inputs.value, inputs.cache, out=torch.empty_like(inputs.query))
    assert inputs.cache[2].tolist() == [3]  # refused before anything ran
