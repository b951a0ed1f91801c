"""The end of a session's decode step (``step_end``): the torch code and the Triton launch must both give
``torch.argmax``'s token and advance the positions and the text as the step's separate ops did."""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_DEVICE

from flashcore.integrations.step_end import chunked_argmax, pick_and_advance_with_torch
from flashcore.kernels.triton.pick_and_advance import pick_and_advance_triton

HISTORY_WIDTH = 12


def _scores_with_ties(batch: int, vocab: int, dtype: torch.dtype, generator) -> torch.Tensor:
    scores = torch.randn(batch, vocab, generator=generator)
    # Ties (the first index wins in torch.argmax) across chunks, inside one chunk, and a row of equal values.
    scores[0, [7, vocab - 1]] = scores[0].max() + 1
    scores[1, [vocab // 3, vocab // 3 + 1]] = scores[1].max() + 1
    scores[2] = 0.5
    return scores.to(dtype)


@pytest.mark.parametrize("implementation", ["torch", "triton"])
@pytest.mark.parametrize("vocab", [128256, 49152, 3000, 1000], ids=["llama3", "smollm2", "short_last", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pick_and_advance_matches_argmax_and_the_separate_updates(implementation, vocab, dtype, generator):
    batch = 5
    scores = _scores_with_ties(batch, vocab, dtype, generator).to(TEST_DEVICE)
    position = torch.randint(0, 1000, (batch, 1), generator=generator).to(TEST_DEVICE)
    cache_position = torch.randint(0, 1000, (1,), generator=generator).to(TEST_DEVICE)
    history = torch.randint(0, vocab, (batch, HISTORY_WIDTH), generator=generator).to(TEST_DEVICE)
    # An empty text, a text one short of full, and a full one (its last slot is overwritten, its length stays).
    history_len = torch.tensor([0, 3, HISTORY_WIDTH - 1, HISTORY_WIDTH, 7], device=TEST_DEVICE)
    expected_token = scores.argmax(dim=-1)
    expected_history = history.clone()
    for row, length in enumerate(history_len.tolist()):
        expected_history[row, min(length, HISTORY_WIDTH - 1)] = expected_token[row]
    for row, length in enumerate(history_len.tolist()):
        expected_history[row, min(length + 1, HISTORY_WIDTH - 1)] = expected_token[row]
    expected = (
        expected_token, position + 2, cache_position + 2, expected_history, (history_len + 2).clamp(max=HISTORY_WIDTH)
    )  # fmt: skip

    token = torch.full((batch,), -1, dtype=torch.long, device=TEST_DEVICE)
    tickets = torch.zeros(batch, dtype=torch.int32, device=TEST_DEVICE)
    run = pick_and_advance_with_torch if implementation == "torch" else pick_and_advance_triton
    for _ in range(2):  # the tickets are back at zero for the next launch
        run(scores, tickets, token, position, cache_position, history, history_len)
        assert not tickets.any()

    names = ("token", "position", "cache_position", "history", "history_len")
    got = (token, position, cache_position, history, history_len)
    for name, value, want in zip(names, got, expected, strict=True):
        assert torch.equal(value, want), name


@pytest.mark.parametrize("implementation", ["torch", "triton"])
@pytest.mark.parametrize("hidden", [64, 4096 + 96], ids=["one_chunk", "two_chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pick_and_advance_writes_the_next_step_inputs(implementation, hidden, dtype, generator):
    """With the next-step inputs: each token's embedding row, and the cos and sin rows of the new position, clamped
    to the table's last row; the rest as without them."""
    batch, vocab, num_positions, head_dim = 4, 3000, 20, 16
    scores = _scores_with_ties(batch, vocab, dtype, generator).to(TEST_DEVICE)
    # The last row steps past the table: its rotary row is the table's last.
    position = torch.tensor([[0], [7], [num_positions - 2], [num_positions - 1]], device=TEST_DEVICE)
    cache_position = torch.zeros(1, dtype=torch.long, device=TEST_DEVICE)
    history = torch.zeros(batch, HISTORY_WIDTH, dtype=torch.long, device=TEST_DEVICE)
    history_len = torch.zeros(batch, dtype=torch.long, device=TEST_DEVICE)
    embedding = torch.randn(vocab, hidden, generator=generator).to(dtype).to(TEST_DEVICE)
    table = torch.randn(num_positions, 2, head_dim, generator=generator).to(dtype).to(TEST_DEVICE)
    next_embeds = torch.full((batch, 1, hidden), float("nan"), dtype=dtype, device=TEST_DEVICE)
    next_rotary = torch.full((batch, 1, 2, head_dim), float("nan"), dtype=dtype, device=TEST_DEVICE)
    expected_token = scores.argmax(dim=-1)
    expected_rows = [min(p + 1, num_positions - 1) for p in position[:, 0].tolist()]

    token = torch.full((batch,), -1, dtype=torch.long, device=TEST_DEVICE)
    tickets = torch.zeros(batch, dtype=torch.int32, device=TEST_DEVICE)
    run = pick_and_advance_with_torch if implementation == "torch" else pick_and_advance_triton
    run(scores, tickets, token, position, cache_position, history, history_len, embedding, next_embeds, table,
        next_rotary)  # fmt: skip

    assert torch.equal(token, expected_token)
    for row in range(batch):
        assert torch.equal(next_embeds[row, 0], embedding[expected_token[row]])
        assert torch.equal(next_rotary[row, 0], table[expected_rows[row]])
    assert position[:, 0].tolist() == [1, 8, num_positions - 1, num_positions]
    assert history[:, 0].tolist() == expected_token.tolist() and not tickets.any()


@pytest.mark.parametrize("vocab", [128256, 49152, 1000, 1021, 100])
def test_chunked_argmax_matches_torch_argmax(vocab, generator):
    for dtype in (torch.float32, torch.bfloat16):
        scores = _scores_with_ties(3, vocab, dtype, generator)
        assert torch.equal(chunked_argmax(scores), scores.argmax(dim=-1))
