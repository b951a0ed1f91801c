"""The end of a decode step in one launch: each row's token picked from its vocabulary chunks' maxima, and the
decode state advanced (positions, the row's text). ``flashcore.integrations.step_end`` defines the result in torch
code and tests this kernel against it.

One program per row: the best chunk (the first of equal maxima, as ``torch.argmax``), the token it holds, then the
stores. Program 0 also advances the cache position, which every row shares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashcore.backends import on_device_of


@triton.jit
def _pick_and_advance_kernel(
    chunk_max_ptr,  # [B, C], contiguous: each chunk's largest score
    index_in_chunk_ptr,  # [B, C] int64, contiguous: where in its chunk that score is
    token_ptr,  # [B] int64, written
    position_ptr,  # [B] int64 (the session's [B, 1]), advanced by 1
    cache_position_ptr,  # [1] int64, advanced by 1
    history_ptr,  # [B, W] int64 with row stride stride_history: the token is appended to the row's text
    history_len_ptr,  # [B] int64, advanced by 1, at most W
    num_chunks,
    chunk,  # vocabulary entries per chunk
    history_width,
    stride_history,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    scores = tl.load(chunk_max_ptr + row * num_chunks + offs_c, mask=offs_c < num_chunks, other=float("-inf"))
    scores = scores.to(tl.float32)  # exact for every float dtype the scores come in
    # torch's max and argmax rank NaN above everything; so does this, except that a +inf chunk before it wins.
    scores = tl.where(scores != scores, float("inf"), scores)
    best = tl.argmax(scores, axis=0, tie_break_left=True)
    token = best.to(tl.int64) * chunk + tl.load(index_in_chunk_ptr + row * num_chunks + best)
    tl.store(token_ptr + row, token)
    tl.store(position_ptr + row, tl.load(position_ptr + row) + 1)
    length = tl.load(history_len_ptr + row)
    tl.store(history_ptr + row * stride_history + tl.minimum(length, history_width - 1), token)
    tl.store(history_len_ptr + row, tl.minimum(length + 1, history_width))
    if row == 0:
        tl.store(cache_position_ptr, tl.load(cache_position_ptr) + 1)


def pick_and_advance_triton(
    chunk_max: torch.Tensor,
    index_in_chunk: torch.Tensor,
    chunk: int,
    token: torch.Tensor,
    position: torch.Tensor,
    cache_position: torch.Tensor,
    history: torch.Tensor,
    history_len: torch.Tensor,
) -> None:
    """The launch; shapes and dtypes as the kernel's comments say, all on one CUDA device (or the CPU under
    ``TRITON_INTERPRET=1``). Safe under CUDA-graph capture."""
    batch, num_chunks = chunk_max.shape
    with on_device_of(token):
        _pick_and_advance_kernel[(batch,)](
            chunk_max, index_in_chunk, token, position, cache_position, history, history_len, num_chunks, chunk,
            history.shape[1], history.stride(0), BLOCK_C=triton.next_power_of_2(num_chunks),
        )  # fmt: skip
