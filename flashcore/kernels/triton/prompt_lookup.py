"""Prompt lookup's draft proposal in one launch: one program per row scans its text for the latest earlier occurrence
of its last n tokens (n from ``MAX_NGRAM`` down to ``MIN_NGRAM``) and copies what followed.

The same result as the torch version in ``flashcore.integrations.prompt_lookup`` (which defines it and runs off
CUDA), without its ~40 small kernels per call: in a captured speculative step those cost about 0.1-0.3 ms on the
H100 at batch 1, a tenth of a decode step (``benchmarks/probes/verify_cost_gpu.py``).
"""

import torch
import triton
import triton.language as tl

from flashcore.backends import on_device_of


@triton.jit
def _prompt_lookup_kernel(
    history_ptr,  # [B, W] int64, row-major
    lengths_ptr,  # [B] int64, each >= 1
    drafts_ptr,  # [B, NUM_DRAFT] int64, out
    has_draft_ptr,  # [B] int8, out
    width,
    NUM_DRAFT: tl.constexpr,
    DRAFT_PAD: tl.constexpr,  # NUM_DRAFT rounded up to a power of two
    MAX_NGRAM: tl.constexpr,
    MIN_NGRAM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    text = history_ptr + row.to(tl.int64) * width
    length = tl.load(lengths_ptr + row)
    last = tl.load(text + length - 1)
    best_start = tl.full((), -1, tl.int64)
    for ngram in tl.static_range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        # Window p matches when text[p + i] == text[length - ngram + i] for every i < ngram, and a token follows it
        # before the suffix starts over itself: p + ngram < length.
        latest = tl.full((), -1, tl.int64)
        for block_start in range(0, length, BLOCK):
            starts = block_start + tl.arange(0, BLOCK).to(tl.int64)
            is_match = starts + ngram < length
            for i in tl.static_range(ngram):
                suffix_token = tl.load(text + tl.maximum(length - ngram + i, 0))
                window_token = tl.load(text + starts + i, mask=is_match, other=-1)
                is_match = is_match & (window_token == suffix_token)
            latest = tl.maximum(latest, tl.max(tl.where(is_match, starts, -1), axis=0))
        found = (best_start < 0) & (latest >= 0)
        best_start = tl.where(found, latest + ngram, best_start)  # where the continuation begins
    offsets = tl.arange(0, DRAFT_PAD)
    index = tl.maximum(best_start, 0) + offsets
    in_text = index < tl.where(best_start >= 0, length, 0)  # no match: nothing is in the text
    drafts = tl.where(in_text, tl.load(text + tl.minimum(index, width - 1)), last)
    tl.store(drafts_ptr + row * NUM_DRAFT + offsets, drafts, mask=offsets < NUM_DRAFT)
    tl.store(has_draft_ptr + row, (best_start >= 0).to(tl.int8))


def propose(history: torch.Tensor, lengths: torch.Tensor, num_draft: int, max_ngram: int, min_ngram: int = 1):
    """``(drafts [B, num_draft] int64, has_draft [B] bool)``, as ``propose_from_history`` defines them, for a
    contiguous int64 ``history [B, W]`` and int64 ``lengths [B]`` (each at least 1) on a CUDA device (or the CPU
    under ``TRITON_INTERPRET=1``). Allocates its outputs; safe under CUDA-graph capture."""
    batch, width = history.shape
    drafts = torch.empty(batch, num_draft, dtype=torch.long, device=history.device)
    has_draft = torch.empty(batch, dtype=torch.int8, device=history.device)
    if batch:
        with on_device_of(history):  # a session whose embeddings sit on another GPU than the current one
            _prompt_lookup_kernel[(batch,)](
                history, lengths, drafts, has_draft, width,
                NUM_DRAFT=num_draft, DRAFT_PAD=triton.next_power_of_2(num_draft),
                MAX_NGRAM=min(max_ngram, width - 1), MIN_NGRAM=min_ngram, BLOCK=1024,
            )  # fmt: skip
    return drafts, has_draft.bool()
