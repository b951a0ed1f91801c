"""Prompt lookup: draft tokens copied from earlier in each row's own text, for a speculative decode step.

The draft for a row whose text ends in the n tokens ``t`` is what followed the latest earlier occurrence of ``t`` (n
from ``max_ngram`` down to ``min_ngram``, the longest match winning), as in transformers' prompt lookup decoding and
vLLM's n-gram proposer. No draft model: an answer that quotes its prompt (summaries, rewrites, code edits, a chat turn
that repeats the conversation) gets most of its tokens accepted. Everything is tensor work of fixed shapes on the rows'
device, with no host read, so a decode step that calls it can be captured in a CUDA graph (on CUDA it is one Triton
launch).
"""

from __future__ import annotations

import torch


def propose_from_history(
    history: torch.Tensor, lengths: torch.Tensor, num_draft: int, max_ngram: int = 3, min_ngram: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(drafts [B, num_draft], has_draft [B])``: draft tokens for each row of ``history``, and which rows found
    an earlier occurrence of their suffix.

    Args:
        history: ``[B, H]`` token ids; row b's text is ``history[b, :lengths[b]]``, the rest is ignored.
        lengths: ``[B]`` int64, each at least 1.
        num_draft: k, the tokens proposed per row.
        max_ngram: the longest suffix matched.
        min_ngram: the shortest (vLLM's ``prompt_lookup_min``): a row whose last ``min_ngram`` tokens never occurred
            before has no draft.

    A row with no match (no earlier occurrence of even its last ``min_ngram`` tokens) gets copies of its last token: a
    draft that the verify step rejects at no extra cost, since every row of the batch is verified anyway. Positions past
    a row's text are never proposed (a continuation is cut at ``lengths[b]`` and padded with the row's last token).

    On CUDA one Triton launch computes it (``flashcore/kernels/triton/prompt_lookup.py``, tested against this
    function's torch code, which runs everywhere else and defines the result).
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
    if history.is_cuda:
        from flashcore.kernels.triton.prompt_lookup import propose

        return propose(history.contiguous(), lengths.long(), num_draft, max_ngram, min_ngram)
    return propose_with_torch(history, lengths, num_draft, max_ngram, min_ngram)


def propose_with_torch(
    history: torch.Tensor, lengths: torch.Tensor, num_draft: int, max_ngram: int = 3, min_ngram: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`propose_from_history` in torch tensor ops (fixed shapes, no host read), on any device."""
    batch, width = history.shape
    positions = torch.arange(width, device=history.device)
    last = history.gather(1, (lengths - 1)[:, None])  # [B, 1]
    best_start = torch.full((batch,), -1, dtype=torch.long, device=history.device)
    for ngram in range(min(max_ngram, width - 1), min_ngram - 1, -1):
        suffix_index = (lengths[:, None] - ngram + torch.arange(ngram, device=history.device)).clamp(min=0)
        suffix = history.gather(1, suffix_index)  # [B, n]
        windows = history.unfold(1, ngram, 1)  # [B, H - n + 1, n]: window p holds tokens [p, p + n)
        starts = positions[: windows.shape[1]]
        # An earlier occurrence: it ends before the suffix starts over itself, and a token follows it in the text.
        is_match = (windows == suffix[:, None, :]).all(dim=-1) & (starts[None, :] + ngram < lengths[:, None])
        latest = torch.where(is_match, starts[None, :], -1).amax(dim=1)  # [B], -1 where none
        found = (best_start < 0) & (latest >= 0)
        best_start = torch.where(found, latest + ngram, best_start)  # where the continuation begins
    draft_index = best_start.clamp(min=0)[:, None] + torch.arange(num_draft, device=history.device)
    in_text = (best_start[:, None] >= 0) & (draft_index < lengths[:, None])
    drafts = history.gather(1, draft_index.clamp(max=width - 1))
    return torch.where(in_text, drafts, last), best_start >= 0
