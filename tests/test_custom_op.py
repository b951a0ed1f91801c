"""``flashcore::attention_with_kv_cache`` as a registered op: opcheck, and torch.compile(fullgraph=True).

The op declares ``mutates_args = (k_cache, v_cache, seq_lens)``; opcheck verifies that claim, the fake
(meta) implementation and functionalization. The compile test traces prefill and decode calls through the
public function with a counting backend, and asserts one graph per function, no recompile across decode
steps, results equal to eager, and the cache mutations landing in the caller's tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import DTYPES, TOLERANCES, poison_, randn
from oracle import check_call, make_call_inputs

import flashcore

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_query_lens", [False, True])
@pytest.mark.parametrize("num_new", [1, 4])
def test_opcheck(backend, use_query_lens, num_new, device, generator):
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=DTYPES[0],
        device=device,
        num_q_heads=4,
        num_kv_heads=2,
        num_new=num_new,
        head_dim=16,
        capacity=12,
        seq_lens=[3, 7],
        query_lens=[num_new, num_new - 1] if use_query_lens else [num_new, num_new],
    )
    query_lens = torch.tensor(inputs.query_lens, dtype=torch.int32, device=device) if use_query_lens else None
    k_cache, v_cache, seq_lens = inputs.cache
    args = (inputs.query, inputs.key, inputs.value, k_cache, v_cache, seq_lens, query_lens)
    # opcheck runs the op several times on clones of the arguments, so the cache never overflows.
    torch.library.opcheck(
        torch.ops.flashcore.attention_with_kv_cache.default, (*args, True, 1.0 / math.sqrt(16), 0, backend)
    )


def _compiled_and_counted(fn):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, backend=counter, fullgraph=True), counter


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_prefill_then_decode(backend, device, generator):
    """Eager and compiled runs from identical caches: equal outputs and caches, one graph per function,
    no recompile over the decode steps (each step is a new set of tensors of the same shapes)."""
    dtype = DTYPES[0]
    batch, num_q_heads, num_kv_heads, head_dim, capacity, prompt_len, num_steps = 2, 6, 2, 32, 24, 7, 5

    def attend(query, key, value, cache):
        return flashcore.attention_with_kv_cache(query, key, value, cache, backend=backend)

    def draw(num_heads, length):
        return randn((batch, num_heads, length, head_dim), generator=generator, dtype=dtype, device=device)

    steps = [
        (draw(num_q_heads, n), draw(num_kv_heads, n), draw(num_kv_heads, n)) for n in [prompt_len] + [1] * num_steps
    ]
    eager_cache = flashcore.allocate_kv_cache(batch, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
    poison_(eager_cache[0])
    poison_(eager_cache[1])
    compiled_cache = tuple(t.clone() for t in eager_cache)

    torch._dynamo.reset()
    compiled_prefill, prefill_counter = _compiled_and_counted(attend)
    compiled_decode, decode_counter = _compiled_and_counted(attend)
    for step, (query, key, value) in enumerate(steps):
        compiled_attend = compiled_prefill if step == 0 else compiled_decode
        with torch._dynamo.config.patch(error_on_recompile=step > 1):
            out, returned = compiled_attend(query, key, value, compiled_cache)
        expected, _ = attend(query, key, value, eager_cache)
        assert all(a is b for a, b in zip(returned, compiled_cache, strict=True))
        assert torch.equal(out, expected)
        for compiled, eager in zip(compiled_cache, eager_cache, strict=True):
            torch.testing.assert_close(compiled, eager, rtol=0, atol=0, equal_nan=True)
        assert compiled_cache[2].tolist() == [prompt_len + step] * batch
    assert prefill_counter.frame_count == 1 and decode_counter.frame_count == 1
    assert prefill_counter.op_count >= 1 and decode_counter.op_count >= 1
    assert torch.equal(compiled_cache[0][:, :, : prompt_len + num_steps], torch.cat([s[1] for s in steps], dim=2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_mixed_batch_matches_oracle(backend, device, generator):
    """A compiled mixed call (query_lens, a window, GQA) against the oracle, with all contract checks."""
    dtype = DTYPES[0]
    seq_lens, query_lens = [0, 10, 4], [5, 1, 3]
    inputs = make_call_inputs(
        randn,
        generator=generator,
        dtype=dtype,
        device=device,
        num_q_heads=6,
        num_kv_heads=3,
        num_new=5,
        head_dim=24,
        capacity=16,
        seq_lens=seq_lens,
        query_lens=query_lens,
    )

    def attend(query, key, value, cache, query_lens):
        return flashcore.attention_with_kv_cache(
            query, key, value, cache, query_lens=query_lens, sliding_window=4, backend=backend
        )

    torch._dynamo.reset()
    compiled, counter = _compiled_and_counted(attend)
    lens = torch.tensor(query_lens, dtype=torch.int32, device=device)
    out, returned = compiled(inputs.query, inputs.key, inputs.value, inputs.cache, lens)
    assert counter.frame_count == 1
    check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True, sliding_window=4)
