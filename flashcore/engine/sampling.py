"""Next-token selection for a batch of rows with their own sampling parameters, on the logits' device.

transformers' ``TopKLogitsWarper`` / ``TopPLogitsWarper`` take one value for the whole batch; a continuous batch
mixes requests with different ``temperature``, ``top_k`` and ``top_p``, so the filters here take one value per row
(vectorised: one sort for all rows). The draw itself is ``torch.multinomial``: rows with a ``seed`` draw from their
own ``torch.Generator`` one at a time, so a seeded request's tokens do not depend on what else is in the batch;
the other sampled rows draw together from the engine's generator. Greedy rows take the argmax (ties to the first
index, as ``generate`` does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashcore.engine.requests import SamplingParams


def select_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[N, V]`` under ``params[i]``; returns int64 ``[N]`` on the device.

    ``generators[i]`` is row i's own generator (a seeded request) or None (draws from ``default_generator``).
    """
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled:
        return tokens
    device = logits.device
    index = to_device(sampled, torch.long, device)
    probs = filtered_probs(
        logits.index_select(0, index),
        temperature=to_device([params[i].temperature for i in sampled], torch.float32, device),
        top_k=to_device([max(params[i].top_k, 0) for i in sampled], torch.long, device),
        top_p=to_device([params[i].top_p for i in sampled], torch.float32, device),
    )
    shared = [j for j, i in enumerate(sampled) if generators[i] is None]
    if shared:
        rows = to_device(shared, torch.long, device)
        draws = torch.multinomial(probs.index_select(0, rows), 1, generator=default_generator).squeeze(1)
        tokens.index_copy_(0, index.index_select(0, rows), draws)
    for j, i in enumerate(sampled):
        if generators[i] is not None:
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return tokens


def filtered_probs(
    logits: torch.Tensor, *, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """``softmax(logits / temperature)`` with each row's top-k and top-p filters applied (0 probability outside).

    ``top_k[i] == 0`` keeps every token; ``top_p[i] == 1`` keeps every token. Like transformers' warpers, top-k
    applies before top-p, and top-p always keeps the most likely token.
    """
    scaled = logits / temperature[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    outside = (top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p.
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_above >= top_p[:, None], float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter_(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without waiting for the device: on CUDA, ``torch.tensor(values,
    device=...)`` copies from pageable memory, which waits for every kernel queued before it (and so undoes the
    engine's overlap of host and device); a pinned staging tensor copies asynchronously."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
