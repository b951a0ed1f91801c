"""``flashcore.rollback``: ``seq_lens[b] -= n_b``, after which the forgotten positions are garbage again.

A rollback is checked by what the next call sees: with the forgotten slots poisoned with NaN, an append-and-attend
on every backend must write at the rolled-back positions and match the oracle over the tokens the rows still hold.
Bad counts raise before anything changes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cases import BACKENDS, call_with_query_lens, inputs_maker
from conftest import TOLERANCES
from oracle import NAN, check_call

import flashcore

SEQ_LENS = [5, 9, 3, 12]


@pytest.fixture
def make_inputs(generator, device):
    return inputs_maker(generator, device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "counts", [[2, 9, 0, 12], 3, 0], ids=["per_row_with_none_and_all", "same_for_every_row", "nothing"]
)
def test_next_call_sees_only_what_the_rows_still_hold(backend, counts, make_inputs):
    dtype = torch.float32
    inputs = make_inputs(
        dtype=dtype, num_q_heads=4, num_kv_heads=2, head_dim=16, capacity=20, seq_lens=SEQ_LENS, query_lens=[2] * 4
    )
    k_cache, v_cache, seq_lens = inputs.cache
    per_row = counts if isinstance(counts, list) else [counts] * len(SEQ_LENS)
    num_tokens = torch.tensor(counts, dtype=torch.int32, device=seq_lens.device) if isinstance(counts, list) else counts

    returned = flashcore.rollback(inputs.cache, num_tokens)

    assert returned is inputs.cache
    kept = [length - count for length, count in zip(SEQ_LENS, per_row, strict=True)]
    assert seq_lens.tolist() == kept
    # The forgotten slots are garbage now: poison them, and the next call must neither read nor keep them.
    for row, length in enumerate(kept):
        k_cache[row, :, length:] = NAN
        v_cache[row, :, length:] = NAN
    after = dataclasses.replace(inputs, seq_lens=kept, k_cache_before=k_cache.clone(), v_cache_before=v_cache.clone())
    out, cache = call_with_query_lens(after, backend=backend)
    check_call(after, out, cache, atol=TOLERANCES[dtype], is_causal=True)


@pytest.mark.parametrize(
    ("num_tokens", "error", "match"),
    [
        (torch.tensor([1, 10, 0, 0], dtype=torch.int32), ValueError, r"cannot roll back 10 tokens of row 1, which"),
        (4, ValueError, r"cannot roll back 4 tokens of row 2"),
        (-1, ValueError, r"num_tokens must be >= 0"),
        (torch.tensor([0, -1, 0, 0], dtype=torch.int32), ValueError, r"cannot roll back -1 tokens of row 1"),
        (torch.tensor([1, 1, 1, 1]), TypeError, r"torch.int32 like seq_lens"),
        (torch.tensor([1, 1], dtype=torch.int32), ValueError, r"seq_lens' shape \(4,\)"),
        (1.0, TypeError, r"an int or an int32 tensor"),
        (True, TypeError, r"an int or an int32 tensor"),
    ],
    ids=["more_than_a_row_holds", "int_more_than_the_shortest", "negative", "negative_in_a_row", "int64", "shape",
         "float", "bool"],
)  # fmt: skip
def test_bad_counts_raise_and_change_nothing(num_tokens, error, match, make_inputs, device):
    inputs = make_inputs(
        dtype=torch.float32, num_q_heads=2, num_kv_heads=1, head_dim=8, capacity=16, seq_lens=SEQ_LENS,
        query_lens=[1] * 4,
    )  # fmt: skip
    if isinstance(num_tokens, torch.Tensor):
        num_tokens = num_tokens.to(device)
    before = [tensor.clone() for tensor in inputs.cache]
    with pytest.raises(error, match=match):
        flashcore.rollback(inputs.cache, num_tokens)
    for tensor, saved in zip(inputs.cache, before, strict=True):
        assert torch.equal(tensor.nan_to_num(), saved.nan_to_num())
