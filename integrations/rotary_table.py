"""A decode session's rotary embedding as one table lookup per step.

HF's ``LlamaRotaryEmbedding`` computes cos and sin from the positions on every forward: eagerly a multiply (a cuBLAS
GEMM with K = 1 before transformers 5.24), a concatenation, cos, sin, two scalings and two casts, seven launches at the
start of each decode step, three in inductor's code. A session knows the largest position it will ever use (its
cache's capacity), so it computes cos and sin once for every position with the model's own rotary module and gathers
the step's rows from the table. Every element is computed by the same ops HF's forward runs, so the table's rows are
bitwise the module's outputs, and eager, replayed and compiled steps all read the same bits.

Only where cos and sin depend on the position alone: the ``dynamic`` and ``longrope`` RoPE types recompute their
frequencies from the longest sequence seen (``dynamic_rope_update``), and keep HF's module.
"""

from __future__ import annotations

import contextlib

import torch

# RoPE types whose frequencies change with the sequence length seen (transformers' dynamic_rope_update).
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


class RotaryTable(torch.nn.Module):
    """``rotary_emb(x, position_ids)`` for positions in ``[0, num_positions)``, gathered from a precomputed table.

    Args:
        rotary_emb: the model's rotary module (``model.base_model.rotary_emb``).
        num_positions: the table's rows; a larger position reads the last row (past a session's capacity its steps
            compute garbage anyway, and a gather past the table would fault the device).
        dtype: the dtype HF's module would return (the hidden states').
    """

    def __init__(self, rotary_emb: torch.nn.Module, num_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        device = rotary_emb.inv_freq.device
        positions = torch.arange(num_positions, device=device)[None]
        cos, sin = rotary_emb(torch.empty(0, dtype=dtype, device=device), positions)  # [1, num_positions, D] each
        # [num_positions, 2, D]: one gather reads a position's cos and sin together.
        self.table = torch.nn.Buffer(torch.stack([cos[0], sin[0]], dim=1), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.table[position_ids.clamp(max=self.table.shape[0] - 1)]  # [B, S, 2, D]
        return rows[..., 0, :], rows[..., 1, :]


class RotaryRows(torch.nn.Module):
    """``rotary_emb(x, position_ids)`` for a decode step whose cos and sin rows were written ahead (by the step before
    it, ``step_end.pick_and_advance``): returns views of ``rows [B, 1, 2, D]``, whatever the positions."""

    def __init__(self, rows: torch.Tensor) -> None:
        super().__init__()
        self.rows = torch.nn.Buffer(rows, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[..., 0, :], self.rows[..., 1, :]


def rotary_table_for(model: torch.nn.Module, num_positions: int) -> RotaryTable | None:
    """A :class:`RotaryTable` of ``model``'s rotary embedding, or None where it has none at ``.base_model.rotary_emb``
    or its cos and sin depend on more than the position."""
    rotary_emb = getattr(model.base_model, "rotary_emb", None)
    if rotary_emb is None or getattr(rotary_emb, "rope_type", None) in LENGTH_DEPENDENT_ROPE_TYPES:
        return None
    with torch.inference_mode():
        return RotaryTable(rotary_emb, num_positions, model.dtype)


@contextlib.contextmanager
def rotary_table_installed(model: torch.nn.Module, table: RotaryTable | RotaryRows | None):
    """Runs the block with ``table`` as the model's rotary module (nothing changes for None), then puts HF's back."""
    if table is None:
        yield
        return
    decoder = model.base_model
    original = decoder.rotary_emb
    decoder.rotary_emb = table
    try:
        yield
    finally:
        decoder.rotary_emb = original
