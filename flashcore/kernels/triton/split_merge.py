"""The protocol every Triton attention body shares: the flash-decoding split merge and the ``seq_lens`` ticket.

**The ticket.** Several programs of one launch read a row's ``seq_lens`` (every KV head, M block and split). The
row may only be advanced once all of them have read it, so each takes a ticket when it is done with it, and the last
taker writes ``seq_lens[b] + n_b`` and resets the ticket (:func:`_advance_seq_lens_after_last_tile`). Only the
attention launch advances ``seq_lens``, never the merge launch after it: the merge releases the next kernel
(programmatic dependent launch) before it waits, and that kernel can be the next call on the same cache.

**The merge.**
With ``USE_SPLIT_KV`` the attention kernel splits each row's cached prefix over several programs; each writes
a normalised partial output and its log2-sum-exp. :func:`_merge_kv_splits` combines them, in one of two places
(the launcher picks; benchmarks/NOTES.md, entry 20):

- inside the attention launch, by the program that takes a tile's last split ticket. One launch instead of
  two saved host time per eager call on the H100 host, where host time is the dominant cost of an eager decode call;
- in :func:`merge_kv_splits`, a second launch. Under CUDA-graph replay there is no host cost, and this is
  faster on the H100: the in-launch merge waits on a fence, an atomic and the L2 loads in one program.

Both run the same helper and give bitwise the same output. Either way no split's load waits on another's:
walking the splits with dependent loads was a serial chain of L2 latencies (entry 2).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashcore.backends import picks_captured_kernels
from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch

# The seq_lens (its address) of the cache whose split attention launch the last merge launch followed, per device.
_last_merged_cache: dict[torch.device, int] = {}


def merges_in_attention_launch(device: torch.device) -> bool:
    """Where a split prefix is merged: in the attention launch when running eagerly, where a second launch's
    host cost dominates; in a second launch while a CUDA graph is captured, because replay has no host cost and
    the separate merge is faster on the H100 (benchmarks/NOTES.md, entry 20), and in an eager warm-up of a step to be
    captured (``backends.kernels_as_captured``). Every decode body asks here."""
    return not picks_captured_kernels(device)


@triton.jit
def _advance_seq_lens_after_last_tile(seq_lens_ptr, row_tickets_ptr, batch, new_seq_len, num_tiles):
    """Writes ``seq_lens[batch]`` once every tile of the row has finished with it (read it, and merged).

    acq_rel orders each tile's reads of seq_lens before its ticket, so the last taker may write.
    """
    row_ticket_ptr = row_tickets_ptr + batch
    if tl.atomic_add(row_ticket_ptr, 1, sem="acq_rel") == num_tiles - 1:
        tl.store(seq_lens_ptr + batch, new_seq_len)
        tl.atomic_xchg(row_ticket_ptr, 0)


@triton.jit
def _merge_kv_splits(
    partial_out_ptr,  # [rows, splits, HEAD_DIM] fp32
    partial_lse_ptr,  # [rows, splits] fp32, -inf for a split that saw no key
    out_ptr,  # [rows, HEAD_DIM], contiguous
    rows,  # [MERGE_ROWS] int64 flat (batch, q head, token) indices of the rows to merge
    is_row_valid,  # [MERGE_ROWS]
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
):
    offs_split = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    mask_split = is_row_valid[:, None] & (offs_split[None, :] < num_splits)
    # .cg reads from L2. Needed in the attention launch, where other SMs wrote the partials moments before;
    # in the separate merge it costs nothing measurable (NOTES.md, entry 22).
    lse = tl.load(
        partial_lse_ptr + rows[:, None] * num_splits + offs_split[None, :],
        mask=mask_split,
        other=float("-inf"),
        cache_modifier=".cg",
    )
    lse_max = tl.max(lse, 1)  # a max is exact in any order
    # A row whose splits are all empty (a padding row) has lse_max = -inf: weights 0, output 0, never NaN.
    lse_shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    # Each output element is summed over the splits in index order by the thread that holds it, so the result
    # does not depend on the tile's layout: the in-launch merge (MERGE_ROWS rows, the attention kernel's warps)
    # and the separate merge (one row) give bitwise the same output, and a graph-replayed decode the same
    # tokens as an eager one. tl.sum's order follows the layout, and with it the two placements differed in
    # the last bit (entry 22). No load depends on a running sum, so all splits' loads can be in flight at once.
    merged = tl.zeros([MERGE_ROWS, HEAD_DIM_PAD], tl.float32)
    weight_sum = tl.zeros([MERGE_ROWS], tl.float32)
    for split in tl.static_range(SPLITS_PAD):
        # A tensor compare: the interpreter rejects a mask built from a scalar one.
        is_split = is_row_valid & (tl.full([MERGE_ROWS], split, tl.int32) < num_splits)
        partial_row = rows * num_splits + split
        split_lse = tl.load(partial_lse_ptr + partial_row, mask=is_split, other=float("-inf"), cache_modifier=".cg")
        partial = tl.load(
            partial_out_ptr + partial_row[:, None] * HEAD_DIM + offs_d[None, :],
            mask=is_split[:, None] & mask_d[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        weight = tl.math.exp2(split_lse - lse_shift)
        weight_sum += weight
        merged += partial * weight[:, None]
    merged = merged / tl.where(weight_sum > 0.0, weight_sum, 1.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty), mask=is_row_valid[:, None] & mask_d[None, :])


@triton.jit
def _merge_kv_splits_kernel(
    partial_out_ptr,  # [B * H_q * S_q, splits, HEAD_DIM] fp32
    partial_lse_ptr,  # [B * H_q * S_q, splits] fp32
    out_ptr,  # [B * H_q * S_q, HEAD_DIM], contiguous
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (launch.uses_programmatic_launch)
):
    """One program per (batch, q head, token) row."""
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    if USE_PDL:
        # The next kernel (a model's o projection) may launch at once and stream its weights while the attention
        # launch and this merge run, waiting for the merge in its own gdc_wait: 14-15 µs off a B=1 step of the
        # Llama-3.2-1B shape on the H100 (benchmarks/NOTES.md, entry 59). So the next kernel may start before the
        # attention launch has finished: see merge_kv_splits.
        gdc_launch_dependents()
        # This launch may start while the attention kernel still runs: wait for all of it (its partials) before
        # the first load.
        gdc_wait()
    _merge_kv_splits(
        partial_out_ptr, partial_lse_ptr, out_ptr, rows, tl.full([1], 1, tl.int1), num_splits,
        HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD, 1,
    )  # fmt: skip


_launch_merge = CachedLauncher(_merge_kv_splits_kernel)


def merge_kv_splits(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    """Writes ``out`` from the partials of a split attention launch on the cache of ``seq_lens`` (which that launch
    advanced itself).

    The merge releases the next kernel before it waits for the attention launch, so a kernel launched right after it
    may start while that launch still writes the cache and advances ``seq_lens``. Only the next attention launch on
    the same cache could read them before its own wait (the Gluon decode kernel does): it asks
    :func:`follows_merge_of` and, if so, waits first."""
    _last_merged_cache[seq_lens.device] = seq_lens.data_ptr()
    head_dim = out.shape[-1]
    num_rows, num_splits = partial_out.shape[0], partial_out.shape[1]
    use_pdl = uses_programmatic_launch(out.device)
    _launch_merge(
        (num_rows, 1, 1),
        (partial_out, partial_lse, out, num_splits),
        dict(
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            USE_PDL=use_pdl,
        ),
        num_warps=4 if head_dim > 64 else 2,
        num_stages=3,
        launch_pdl=use_pdl,
    )  # fmt: skip


def follows_merge_of(seq_lens: torch.Tensor) -> bool:
    """Whether the last merge launched on ``seq_lens``' device followed an attention launch on that cache. A launch
    in the same stream right after it may start before that attention launch finishes (see :func:`merge_kv_splits`),
    so an attention launch on the same cache that reads the cache before its PDL wait must not, when this says so.
    Host order is launch order, captured graphs included; an answer of True for a merge that other launches already
    followed only costs that launch its early reads."""
    return _last_merged_cache.get(seq_lens.device) == seq_lens.data_ptr()
