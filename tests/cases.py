"""Setup shared by the contract tests (test_contract*.py): the backends, the call under test, and its inputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import randn
from oracle import CallInputs, make_call_inputs

import flashcore

# The torch backend twice: its default kernel (SDPA), and its reference forced (conftest's torch_kernel fixture).
TORCH_SDPA = pytest.param("torch", marks=pytest.mark.torch_kernel("torch.sdpa"), id="torch")
TORCH_REFERENCE = pytest.param("torch", marks=pytest.mark.torch_kernel("torch.reference"), id="torch_reference")
BACKENDS = [TORCH_SDPA, TORCH_REFERENCE, "triton"]


def call_with_query_lens(inputs: CallInputs, **kwargs):
    """The call under test, with ``query_lens`` passed as an int32 tensor even where it equals S_q."""
    query_lens = torch.tensor(inputs.query_lens, dtype=torch.int32, device=inputs.query.device)
    return flashcore.attention_with_kv_cache(
        inputs.query, inputs.key, inputs.value, inputs.cache, query_lens=query_lens, **kwargs
    )


def inputs_maker(generator: torch.Generator, device) -> Callable[..., CallInputs]:
    """:func:`oracle.make_call_inputs` bound to a test's generator and device, for a test's ``make_inputs`` fixture.

    Only what differs per test is left to give: the dtype and the shape, where the padded number of new tokens
    (S_q) is ``max(query_lens)``. ``device`` may be overridden for a test that must run on the CPU.
    """

    def make_inputs(
        *,
        dtype: torch.dtype,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        seq_lens: list[int],
        query_lens: list[int],
        device=device,
    ) -> CallInputs:
        return make_call_inputs(
            randn,
            generator=generator,
            dtype=dtype,
            device=device,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            num_new=max(query_lens),
            head_dim=head_dim,
            capacity=capacity,
            seq_lens=seq_lens,
            query_lens=query_lens,
        )

    return make_inputs
