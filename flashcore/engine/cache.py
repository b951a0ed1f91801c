"""``EngineCache``: the engine's rows as one :class:`~flashcore.integrations.cache.FlashCoreCache`, and the layout
of the tokens that one forward brings to them.

Each of the ``num_rows`` rows holds one conversation, under the contract of :func:`flashcore.attention_with_kv_cache`.
A forward runs one :class:`StepLayout`, set by the engine before it calls the model:

- **decode** (``token_index`` None): the model's input is ``[num_rows_used, 1]``, one token per row; rows with
  ``query_lens[b] == 0`` are not stepping and nothing is written for them. This is the step the engine replays as a
  CUDA graph, one per bucket of ``num_rows_used`` (the buffers are static; only their contents change).
- **packed** (``token_index`` given): the model's input is ``[1, T]``, every row's new tokens one after another, so
  the projections and the MLP run over exactly the T real tokens (decode rows and prefill chunks alike). Inside
  each attention call the T tokens are scattered to ``[num_rows_used, max_new]`` (token t of the step goes to
  flat slot ``token_index[t]`` = row * max_new + offset), attended with per-row ``query_lens`` in one launch of
  the mixed-row kernel, and gathered back.

Every layer's ``seq_lens`` is a row of one ``[num_layers, num_rows]`` tensor, so the engine sets a row's length on
every layer in one write (a new request keeps the part of the row's tokens that its prompt repeats, and the rest
becomes garbage, per the contract).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashcore.backends import is_capturing_or_tracing
from flashcore.integrations.cache import FlashCoreCache
from flashcore.ops import attention_with_kv_cache


@dataclass
class StepLayout:
    """Where one forward's tokens go: rows ``[first_row, first_row + num_rows_used)`` of the cache, ``query_lens``
    ``int32 [num_rows_used]`` (see the module docstring)."""

    num_rows_used: int
    query_lens: torch.Tensor
    token_index: torch.Tensor | None = None  # packed steps: int64 [T], flat (row, offset) slot of each token
    max_new: int = 1  # packed steps: the most new tokens of any row
    first_row: int = 0  # eager steps skip the rows below their lowest stepping row; graphs start at row 0


class EngineCache(FlashCoreCache):
    """A FlashCoreCache of ``num_rows`` rows, all layers allocated up front, stepped by :class:`StepLayout`."""

    def __init__(
        self,
        config,
        *,
        num_rows: int,
        max_cache_len: int,
        device: torch.device,
        dtype: torch.dtype,
        backend=None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__(
            config, max_cache_len, max_batch_size=num_rows, device=device, dtype=dtype, backend=backend, tp_size=tp_size
        )
        self.num_rows = num_rows
        self.seq_lens = torch.zeros(len(self.layers), num_rows, dtype=torch.int32, device=device)
        for layer, seq_lens in zip(self.layers, self.seq_lens, strict=True):
            layer.seq_lens = seq_lens  # a view: contiguous, advanced in place by the kernel
        self.layout: StepLayout | None = None

    def set_row_length(self, row: int, length: int) -> None:
        """Row ``row`` keeps its first ``length`` tokens on every layer; the positions past them become garbage."""
        self.seq_lens[:, row] = length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Returns its inputs: :meth:`append_and_attend` appends (the batch is the layout's, not ``num_rows``)."""
        if not is_capturing_or_tracing() and not self.in_patched_forward:
            raise RuntimeError("EngineCache runs only under a model patched by apply_flashcore_to_llama")
        return key_states, value_states

    def append_and_attend(
        self, layer_idx, query, key, value, *, query_lens=None, scale=None, backend="auto", token_major=False
    ):
        """One layer's step under ``self.layout``: append and attend in one launch; returns ``[B, H_q, S_q, D]``,
        contiguous: ``token_major`` is a layout preference (``FlashCoreCache.append_and_attend``) that the engine's
        calls, through the op, do not take."""
        layout = self.layout
        if layout is None:
            raise RuntimeError("EngineCache is stepped by the engine: set cache.layout before the forward")
        layer = self.layers[layer_idx]
        rows = layout.num_rows_used
        span = slice(layout.first_row, layout.first_row + rows)
        cache = (layer.keys[span], layer.values[span], layer.seq_lens[span])
        options = dict(query_lens=layout.query_lens, scale=scale, backend=self.backend or backend, check=False)
        if layout.token_index is None:
            out, _ = attention_with_kv_cache(query, key, value, cache, **options)
        else:
            index, width = layout.token_index, layout.max_new
            query, key, value = (_scatter_rows(tensor, index, rows, width) for tensor in (query, key, value))
            out, _ = attention_with_kv_cache(query, key, value, cache, **options)
            out = _gather_rows(out, index)
        if layer_idx == len(self.layers) - 1 and not is_capturing_or_tracing():
            self.in_patched_forward = False
        return out


def _scatter_rows(tokens: torch.Tensor, index: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``[1, H, T, D]`` packed tokens to ``[rows, H, width, D]``; slots no token lands on are zero."""
    _, heads, _, head_dim = tokens.shape
    padded = tokens.new_zeros(rows * width, heads, head_dim)
    padded.index_copy_(0, index, tokens[0].transpose(0, 1))
    return padded.view(rows, width, heads, head_dim).transpose(1, 2)


def _gather_rows(out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_scatter_rows` for the kernel's ``[rows, H, width, D]`` output: ``[1, H, T, D]``."""
    rows, heads, width, head_dim = out.shape
    flat = out.transpose(1, 2).reshape(rows * width, heads, head_dim)
    return flat.index_select(0, index).transpose(0, 1)[None]
