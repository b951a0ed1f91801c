"""Property test: random shapes, lengths and masks against the fp64 oracle, with every contract rule checked.

Hypothesis draws the sizes (B, H_kv, group, S_q, D, S_max), per-row ``seq_lens`` and ``query_lens`` (or one
length for every row and no ``query_lens``: a uniform batch), causal or not, a window or not, and a seed for the
N(0, 1) data. Each example then goes through :func:`oracle.check_call`. The search is derandomized so that CI
sees the same examples every run; the triton backend gets few examples on the CPU because every interpreter launch
costs ~0.1-0.3 s.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from cases import BACKENDS
from conftest import DTYPES, ON_GPU, TOLERANCES, randn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import check_call, make_call_inputs

import flashcore


@dataclass
class Case:
    num_kv_heads: int
    group: int
    num_new: int
    head_dim: int
    capacity: int
    seq_lens: list[int]
    query_lens: list[int]
    is_uniform: bool
    is_causal: bool
    sliding_window: int | None
    dtype: torch.dtype
    seed: int


@st.composite
def cases(draw) -> Case:
    batch = draw(st.integers(1, 4))
    num_new = draw(st.sampled_from([1, 1, 2, 3, 5, 8, 16, 17, 33]))
    capacity = draw(st.integers(num_new, 96))
    is_uniform = draw(st.booleans())
    if is_uniform:  # every row the same length and S_q new tokens, query_lens None: one batched call on SDPA
        query_lens = [num_new] * batch
        seq_lens = [draw(st.integers(0, capacity - num_new))] * batch
    else:
        query_lens = draw(st.lists(st.integers(0, num_new), min_size=batch, max_size=batch))
        seq_lens = [draw(st.integers(0, capacity - new)) for new in query_lens]
    return Case(
        num_kv_heads=draw(st.integers(1, 3)),
        group=draw(st.sampled_from([1, 2, 3, 4, 7, 8])),
        num_new=num_new,
        head_dim=draw(st.integers(1, 256)),
        capacity=capacity,
        seq_lens=seq_lens,
        query_lens=query_lens,
        is_uniform=is_uniform,
        is_causal=draw(st.booleans()),
        sliding_window=draw(st.none() | st.integers(1, 40)),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# The torch backend is cheap; the triton interpreter pays per launch, so it gets a small budget on the CPU.
# On the GPU nearly every example compiles a new kernel specialization (~3 s each), so the GPU run draws
# fewer; on the CPU the interpreter compiles nothing but runs each launch slowly.
# The torch reference runs only where the SDPA kernel may not (graph capture, compile tracing), so it gets fewer.
EXAMPLES = {"torch.sdpa": 300, "torch.reference": 100, "triton": 60 if ON_GPU else 100}


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_oracle(backend, torch_kernel, device):
    @settings(
        max_examples=EXAMPLES[torch_kernel or backend],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(case=cases())
    def check(case: Case) -> None:
        generator = torch.Generator().manual_seed(case.seed)
        inputs = make_call_inputs(
            randn,
            generator=generator,
            dtype=case.dtype,
            device=device,
            num_q_heads=case.group * case.num_kv_heads,
            num_kv_heads=case.num_kv_heads,
            num_new=case.num_new,
            head_dim=case.head_dim,
            capacity=case.capacity,
            seq_lens=case.seq_lens,
            query_lens=case.query_lens,
        )
        out, returned = flashcore.attention_with_kv_cache(
            inputs.query,
            inputs.key,
            inputs.value,
            inputs.cache,
            query_lens=None if case.is_uniform else torch.tensor(case.query_lens, dtype=torch.int32, device=device),
            is_causal=case.is_causal,
            sliding_window=case.sliding_window,
            backend=backend,
        )
        check_call(
            inputs,
            out,
            returned,
            atol=TOLERANCES[case.dtype],
            is_causal=case.is_causal,
            sliding_window=case.sliding_window,
        )

    check()
