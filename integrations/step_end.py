"""The end of a session's decode step: the greedy pick (or the Gumbel-max sample's) and the decode state's advance.

A pick over a large vocabulary runs in two passes (:func:`chunk_maxima`, then the best chunk). After it a decode
step writes the token, advances each row's RoPE position and the shared cache position, appends the token to each
row's text and, where the session asks, writes the next step's inputs (the token's embedding row, the new position's
cos and sin). :func:`pick_and_advance` does all of it in one launch on CUDA
(``flashcore/kernels/triton/pick_and_advance.py``, tested against the torch code here, which runs everywhere else
and defines the result), a ``torch.library`` op that inductor leaves alone in a compiled step.
"""

from __future__ import annotations

import torch

# Vocabulary entries per chunk of the pick's first pass, the largest that divides the vocabulary.
CHUNK_SIZES = (1024, 512, 256, 128)


def chunk_maxima(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(chunk_max [B, C], index_in_chunk [B, C], chunk)``: the largest of each ``chunk`` consecutive scores of
    ``scores [B, V]`` and where in its chunk it is (the first of equal ones, as ``torch.max``).

    One row of a large vocabulary is a single-program reduction in both eager PyTorch and inductor (H100,
    V = 128256, B = 1: 36 us eager, 29 us compiled, per decode step); chunks spread this pass over V / chunk
    programs. A vocabulary no chunk size divides is one chunk.
    """
    batch, vocab = scores.shape
    chunk = next((size for size in CHUNK_SIZES if vocab % size == 0 and vocab > size), vocab)
    chunk_max, index_in_chunk = scores.view(batch, vocab // chunk, chunk).max(dim=-1)
    return chunk_max, index_in_chunk, chunk


def pick_from_chunks(chunk_max: torch.Tensor, index_in_chunk: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B]`` int64: the index of each row's largest score, from :func:`chunk_maxima`'s outputs (the first of equal
    ones, as ``torch.argmax``)."""
    best_chunk = chunk_max.argmax(dim=-1, keepdim=True)
    return (best_chunk * chunk + index_in_chunk.gather(-1, best_chunk)).squeeze(-1)


def chunked_argmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)`` for ``[B, V]`` in the two passes; ties go to the first index, as in torch."""
    return pick_from_chunks(*chunk_maxima(scores))


def append_history(history: torch.Tensor, history_len: torch.Tensor, tokens: torch.Tensor, counts) -> None:
    """Appends each row's first ``counts[b]`` (a ``[B]`` tensor or an int) of ``tokens [B, n]`` to its text,
    ``history [B, W]`` of ``history_len [B]`` tokens (the rest lands past its end, where it is ignored; a full row keeps
    its last slot overwritten). Device tensor work only, so a captured step can do it."""
    width = history.shape[1]
    index = history_len[:, None]
    if tokens.shape[1] > 1:
        index = index + torch.arange(tokens.shape[1], device=tokens.device)
    history.scatter_(1, index.clamp(max=width - 1), tokens)
    history_len.add_(counts).clamp_(max=width)


def pick_and_advance(
    scores: torch.Tensor,
    tickets: torch.Tensor,
    token: torch.Tensor,
    position: torch.Tensor,
    cache_position: torch.Tensor,
    history: torch.Tensor,
    history_len: torch.Tensor,
    embedding: torch.Tensor | None = None,
    next_embeds: torch.Tensor | None = None,
    rotary_table: torch.Tensor | None = None,
    next_rotary: torch.Tensor | None = None,
) -> None:
    """Writes ``token [B]``, the index of each row's largest score in ``scores [B, V]`` (the first of equal ones, as
    ``torch.argmax``), adds 1 to ``position [B, 1]`` and ``cache_position [1]``, and appends the token to each row's
    text (:func:`append_history`). ``tickets [B]`` int32 is the launch's scratch, zero before and after. The session's
    buffers: int64 (``tickets`` int32), contiguous, on the scores' device.

    With the other four (all or none): ``next_embeds [B, 1, H]`` gets each token's row of ``embedding [V, H]`` (an
    ``nn.Embedding``'s weight, unit stride along H), and ``next_rotary [B, 1, 2, D]`` the row of ``rotary_table [P, 2,
    D]`` (``rotary_table.RotaryTable``'s) at the new position, clamped to ``P - 1`` as the table's lookup clamps it:
    the next step's inputs (:func:`next_step_inputs`)."""
    args = (scores, tickets, token, position, cache_position, history, history_len)
    args += (embedding, next_embeds, rotary_table, next_rotary)
    if torch.compiler.is_compiling():
        torch.ops.flashcore.pick_and_advance(*args)
    else:
        _pick_and_advance(*args)


def pick_and_advance_with_torch(
    scores: torch.Tensor,
    tickets: torch.Tensor,
    token: torch.Tensor,
    position: torch.Tensor,
    cache_position: torch.Tensor,
    history: torch.Tensor,
    history_len: torch.Tensor,
    embedding: torch.Tensor | None = None,
    next_embeds: torch.Tensor | None = None,
    rotary_table: torch.Tensor | None = None,
    next_rotary: torch.Tensor | None = None,
) -> None:
    """:func:`pick_and_advance` in torch tensor ops, on any device (``tickets`` stays zero)."""
    token.copy_(chunked_argmax(scores))
    position.add_(1)
    cache_position.add_(1)
    append_history(history, history_len, token[:, None], 1)
    if embedding is not None:
        next_step_inputs(token, position, embedding, next_embeds, rotary_table, next_rotary)


def next_step_inputs(
    token: torch.Tensor,
    position: torch.Tensor,
    embedding: torch.Tensor,
    next_embeds: torch.Tensor,
    rotary_table: torch.Tensor,
    next_rotary: torch.Tensor,
) -> None:
    """Writes a decode step's inputs for ``token [B]`` at ``position [B, 1]``: its embedding row into ``next_embeds``,
    the position's cos and sin rows (clamped to the table) into ``next_rotary`` (shapes as in
    :func:`pick_and_advance`). What the model's embedding and ``RotaryTable`` would compute at the step's start."""
    next_embeds.view(token.shape[0], -1).copy_(embedding[token])
    rows = rotary_table.view(rotary_table.shape[0], -1)[position[:, 0].clamp(max=rotary_table.shape[0] - 1)]
    next_rotary.view(token.shape[0], -1).copy_(rows)


def _pick_and_advance(*args) -> None:
    if args[0].is_cuda:
        from flashcore.kernels.triton.pick_and_advance import pick_and_advance_triton

        pick_and_advance_triton(*args)
    else:
        pick_and_advance_with_torch(*args)


@torch.library.custom_op(
    "flashcore::pick_and_advance",
    mutates_args=(
        "tickets", "token", "position", "cache_position", "history", "history_len", "next_embeds", "next_rotary",
    ),
)  # fmt: skip
def _pick_and_advance_op(
    scores: torch.Tensor,
    tickets: torch.Tensor,
    token: torch.Tensor,
    position: torch.Tensor,
    cache_position: torch.Tensor,
    history: torch.Tensor,
    history_len: torch.Tensor,
    embedding: torch.Tensor | None,
    next_embeds: torch.Tensor | None,
    rotary_table: torch.Tensor | None,
    next_rotary: torch.Tensor | None,
) -> None:
    _pick_and_advance(
        scores, tickets, token, position, cache_position, history, history_len, embedding, next_embeds, rotary_table,
        next_rotary,
    )  # fmt: skip


@_pick_and_advance_op.register_fake
def _(*args) -> None:
    return None
