"""The end of a decode step in one launch: each row's token picked from its scores (``argmax``), and the decode state
advanced (positions, the row's text). ``flashcore.integrations.step_end`` defines the result in torch code and tests
this kernel against it.

A row of a large vocabulary is too long for one program (128256 scores), so each program takes a chunk of
``BLOCK_V`` scores and writes its largest and where it is. The row's last program to finish, which a ticket tells
(as the ``seq_lens`` ticket of ``split_merge.py``), picks the best chunk (the first of equal maxima, as
``torch.argmax``) and writes the token, the positions and the text, then resets the ticket. Program 0 of the row
grid also advances the cache position, which every row shares.

With ``embedding`` and ``rotary_table`` the last program also writes the next step's inputs: the token's embedding
row and the cos and sin rows of the row's new position. The next step then starts with its first projection, not
with the embedding's, the position clamp's and the rotary gather's launches (``benchmarks/NOTES.md``, entry 61).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from flashcore.backends import on_device_of
from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch

BLOCK_V = 1024  # scores per program
MAX_BLOCK_H = 4096  # embedding values per chunk of the copy


@triton.jit
def _pick_and_advance_kernel(
    scores_ptr,  # [B, V], unit stride along V
    chunk_max_ptr,  # [B, C] fp32 scratch: each chunk's largest score
    chunk_index_ptr,  # [B, C] int64 scratch: that score's index in the row
    tickets_ptr,  # [B] int32, zero between launches: the row's chunks done
    token_ptr,  # [B] int64, written
    position_ptr,  # [B] int64 (the session's [B, 1]), advanced by 1
    cache_position_ptr,  # [1] int64, advanced by 1
    history_ptr,  # [B, W] int64 with row stride stride_history: the token is appended to the row's text
    history_len_ptr,  # [B] int64, advanced by 1, at most W
    embedding_ptr,  # [V, H] with row stride stride_embedding; read only when NEXT_INPUTS
    next_embeds_ptr,  # [B, H] contiguous, written only when NEXT_INPUTS: the token's embedding row
    rotary_table_ptr,  # [P, R] contiguous (R = 2 * D: cos then sin); read only when NEXT_INPUTS
    next_rotary_ptr,  # [B, R] contiguous, written only when NEXT_INPUTS: the new position's row (at most P - 1)
    vocab,
    num_chunks,
    stride_scores,
    history_width,
    stride_history,
    hidden,
    stride_embedding,
    num_positions,
    rotary_width,
    BLOCK_V: tl.constexpr,
    BLOCK_C: tl.constexpr,  # num_chunks, padded to a power of two
    NEXT_INPUTS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # the embedding row's chunk; used only when NEXT_INPUTS
    BLOCK_R: tl.constexpr,  # rotary_width, padded to a power of two; used only when NEXT_INPUTS
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (launch.uses_programmatic_launch)
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    if USE_PDL:
        gdc_wait()  # the scores come from the kernel before

    # stage 1: this chunk's largest score, and where it is
    offs_v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    scores = tl.load(scores_ptr + row.to(tl.int64) * stride_scores + offs_v, mask=offs_v < vocab, other=float("-inf"))
    scores = scores.to(tl.float32)  # exact for every float dtype the scores come in
    # torch's max and argmax rank NaN above everything; so does this, except that a +inf before it wins.
    scores = tl.where(scores != scores, float("inf"), scores)
    index = tl.argmax(scores, axis=0, tie_break_left=True)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, tl.max(scores, axis=0))
    tl.store(chunk_index_ptr + row * num_chunks + chunk, chunk.to(tl.int64) * BLOCK_V + index)

    # stage 2, by the row's last program: the best chunk's index is the token. acq_rel orders every chunk's stores
    # before its ticket, and the last taker's loads (from L2: .cg) after.
    if tl.atomic_add(tickets_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
        offs_c = tl.arange(0, BLOCK_C)
        maxima = tl.load(
            chunk_max_ptr + row * num_chunks + offs_c,
            mask=offs_c < num_chunks,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        # Independent of the pick: loaded before it, so that their latency overlaps.
        position = tl.load(position_ptr + row)
        length = tl.load(history_len_ptr + row)
        if NEXT_INPUTS:
            offs_r = tl.arange(0, BLOCK_R)
            rotary_row = tl.minimum(position + 1, num_positions - 1)
            rotary = tl.load(rotary_table_ptr + rotary_row * rotary_width + offs_r, mask=offs_r < rotary_width)
            tl.store(next_rotary_ptr + row * rotary_width + offs_r, rotary, mask=offs_r < rotary_width)
        best = tl.argmax(maxima, axis=0, tie_break_left=True)
        token = tl.load(chunk_index_ptr + row * num_chunks + best, cache_modifier=".cg")
        tl.store(token_ptr + row, token)
        tl.store(position_ptr + row, position + 1)
        tl.store(history_ptr + row * stride_history + tl.minimum(length, history_width - 1), token)
        tl.store(history_len_ptr + row, tl.minimum(length + 1, history_width))
        if NEXT_INPUTS:
            offs_h = tl.arange(0, BLOCK_H)
            for start in range(0, hidden, BLOCK_H):
                mask_h = start + offs_h < hidden
                embeds = tl.load(embedding_ptr + token * stride_embedding + start + offs_h, mask=mask_h)
                tl.store(next_embeds_ptr + row.to(tl.int64) * hidden + start + offs_h, embeds, mask=mask_h)
        tl.atomic_xchg(tickets_ptr + row, 0)
    if chunk == 0 and row == 0:
        tl.store(cache_position_ptr, tl.load(cache_position_ptr) + 1)


_launch_pick_and_advance = CachedLauncher(_pick_and_advance_kernel)


def pick_and_advance_triton(
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
    """The launch; shapes and dtypes as the kernel's comments say, all on one CUDA device (or the CPU under
    ``TRITON_INTERPRET=1``); ``next_embeds``, ``rotary_table`` and ``next_rotary`` contiguous in any shape of those
    sizes. Safe under CUDA-graph capture (the scratch comes from the caching allocator)."""
    batch, vocab = scores.shape
    num_chunks = triton.cdiv(vocab, BLOCK_V)
    next_inputs = embedding is not None
    hidden = embedding.shape[1] if next_inputs else 1
    rotary_width = next_rotary.numel() // batch if next_inputs else 1
    chunk_max = torch.empty(batch, num_chunks, dtype=torch.float32, device=scores.device)
    chunk_index = torch.empty(batch, num_chunks, dtype=torch.long, device=scores.device)
    use_pdl = uses_programmatic_launch(scores.device)
    with on_device_of(scores):
        _launch_pick_and_advance(
            (num_chunks, batch, 1),
            (
                scores, chunk_max, chunk_index, tickets, token, position, cache_position, history, history_len,
                embedding if next_inputs else token, next_embeds if next_inputs else token,
                rotary_table if next_inputs else token, next_rotary if next_inputs else token, vocab, num_chunks,
                scores.stride(0), history.shape[1], history.stride(0), hidden,
                embedding.stride(0) if next_inputs else 1,
                rotary_table.numel() // rotary_width if next_inputs else 1, rotary_width,
            ),
            dict(
                BLOCK_V=BLOCK_V, BLOCK_C=triton.next_power_of_2(num_chunks), NEXT_INPUTS=next_inputs,
                BLOCK_H=min(triton.next_power_of_2(hidden), MAX_BLOCK_H),
                BLOCK_R=triton.next_power_of_2(rotary_width), USE_PDL=use_pdl,
            ),
            num_warps=4,
            num_stages=1,
            launch_pdl=use_pdl,
        )  # fmt: skip
