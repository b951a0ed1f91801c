"""The append-and-attend kernel: one body for prefill, decode and mixed batches, plus its thin launcher.

Semantics are :func:`flashcore.ops.attention_with_kv_cache`'s. The kernel never reads the slots it appends
to: the cached prefix ``[0, L_b)`` comes from the cache and the new tokens come straight from ``key`` and
``value``. That makes the append race-free inside one launch (no program waits for another's write) and is
why prefill, decode and mixed rows can share it.

Grid: ``(B * H_kv, M blocks, KV splits)``. The M dimension packs (new token, query head of the GQA group)
pairs, row ``r`` being token ``r // GROUP`` of query head ``kv_head * GROUP + r % GROUP``, so each K/V tile
is loaded once per KV head rather than once per query head.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashcore.kernels import configs
from flashcore.kernels.call import KernelCall
from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch
from flashcore.kernels.scratch import scratch_buffer, split_partials
from flashcore.kernels.triton import split_merge
from flashcore.kernels.triton.split_merge import _advance_seq_lens_after_last_tile, _merge_kv_splits
from flashcore.kernels.triton.tiles import _attend_loaded_tile, _attend_tiles, _load_tile

NAME = "triton.attention"


@triton.jit
def _attention_with_kv_cache_kernel(
    q_ptr,  # [B, H_q, S_q, D]
    k_ptr,  # [B, H_kv, S_q, D]: the new tokens' keys
    v_ptr,  # [B, H_kv, S_q, D]
    k_cache_ptr,  # [B, H_kv, S_max, D]
    v_cache_ptr,  # [B, H_kv, S_max, D]
    seq_lens_ptr,  # [B] int32: tokens cached before this call; the row's last program advances it
    query_lens_ptr,  # [B] int32: valid new tokens per row; only read when HAS_QUERY_LENS
    out_ptr,  # [B, H_q, S_q, D], contiguous
    partial_out_ptr,  # USE_SPLIT_KV only: [B * H_q * S_q, splits, D] fp32 normalised partial outputs
    partial_lse_ptr,  # USE_SPLIT_KV only: [B * H_q * S_q, splits] fp32 log2-sum-exp of each partial
    row_tickets_ptr,  # [B] int32, zero between calls: the last tile of a row to finish resets it
    tile_tickets_ptr,  # USE_LAST_SPLIT_MERGE only: [B * H_kv * M blocks] int32, zero between calls (reset alike)
    stride_q_b,
    stride_q_h,
    stride_q_s,
    stride_q_d,
    stride_k_b,
    stride_k_h,
    stride_k_s,
    stride_k_d,
    stride_v_b,
    stride_v_h,
    stride_v_s,
    stride_v_d,
    stride_kc_b,
    stride_kc_h,
    stride_kc_s,
    stride_kc_d,
    stride_vc_b,
    stride_vc_h,
    stride_vc_s,
    stride_vc_d,
    num_kv_heads,
    num_new,  # S_q
    capacity,  # S_max
    rows_per_group,  # (batch, KV head) rows per launch-order group (configs.rows_per_launch_group)
    qk_scale,
    window,
    GROUP: tl.constexpr,  # H_q // H_kv
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    HAS_QUERY_LENS: tl.constexpr,
    USE_SPLIT_KV: tl.constexpr,
    USE_LAST_SPLIT_MERGE: tl.constexpr,  # with USE_SPLIT_KV: the tile's last split merges (else a second launch)
    SPLITS_PAD: tl.constexpr,  # USE_LAST_SPLIT_MERGE only: next power of two >= the number of splits
    MERGE_ROWS: tl.constexpr,  # USE_LAST_SPLIT_MERGE only: packed rows merged per step (bounds its registers)
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (launch.uses_programmatic_launch)
    DOT_PRECISION: tl.constexpr,
    NEW_TILE: tl.constexpr,  # > 0: every new token fits one key tile of this size (configs.new_tokens_tile)
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM_PAD >= 16, "tl.dot needs tiles >= 16")
    # -- launch order --
    # Longest first, within groups of (batch, KV head) rows whose K/V fit in L2 together. Axis 0 varies fastest
    # in launch order; the i-th program of a group takes its row i % rows_in_group and, counting from the last,
    # its M block i // rows_in_group. Every row's heaviest causal block starts before its lighter ones and the
    # lightest fill the tail wave, while the rows that the running programs stream share L2
    # (configs.rows_per_launch_group; NOTES.md, entry 24). With one M block (decode) this is the identity.
    num_rows = tl.num_programs(0)
    num_m_blocks = tl.num_programs(1)
    launch_index = tl.program_id(1) * num_rows + tl.program_id(0)
    first_row = (launch_index // (rows_per_group * num_m_blocks)) * rows_per_group
    rows_in_group = tl.minimum(num_rows - first_row, rows_per_group)
    index_in_group = launch_index - first_row * num_m_blocks
    pid_bh = first_row + index_in_group % rows_in_group
    pid_m = num_m_blocks - 1 - index_in_group // rows_in_group
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    batch = (pid_bh // num_kv_heads).to(tl.int64)
    kv_head = (pid_bh % num_kv_heads).to(tl.int64)

    # -- programmatic dependent launch --
    # A PDL launch may start before the previous kernel in the stream has finished: nothing above touches memory,
    # and the wait holds every load and store below until that kernel's writes are visible. Where the split merge
    # is a second launch (launched the same way), the trigger lets it launch while this one streams the cache.
    if USE_PDL:
        gdc_wait()
        if USE_SPLIT_KV and not USE_LAST_SPLIT_MERGE:
            gdc_launch_dependents()

    # -- row metadata --
    # With check=False seq_lens may be negative or past capacity; reads and writes stay inside the cache.
    seq_len_before = tl.load(seq_lens_ptr + batch)
    seq_len = tl.minimum(tl.maximum(seq_len_before, 0), capacity)
    if HAS_QUERY_LENS:
        row_new = tl.load(query_lens_ptr + batch)
    else:
        row_new = num_new
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    HAS_D_MASK: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    token = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    is_row_in_grid = token < num_new
    is_row_new = token < row_new
    first_token = (pid_m * BLOCK_M) // GROUP
    last_token = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, row_new - 1)

    k_new_ptr = k_ptr + batch * stride_k_b + kv_head * stride_k_h
    v_new_ptr = v_ptr + batch * stride_v_b + kv_head * stride_v_h
    k_cache_row_ptr = k_cache_ptr + batch * stride_kc_b + kv_head * stride_kc_h
    v_cache_row_ptr = v_cache_ptr + batch * stride_vc_b + kv_head * stride_vc_h

    # -- append new K/V --
    # Each token is written by the M block that holds its first packed row, so no slot is written twice.
    if split == 0:
        append_token = tl.cdiv(pid_m * BLOCK_M, GROUP) + tl.arange(0, BLOCK_M)
        append_end = tl.minimum(tl.cdiv(pid_m * BLOCK_M + BLOCK_M, GROUP), row_new)
        mask_append = (append_token < append_end) & (seq_len + append_token < capacity)
        mask_append_2d = mask_append[:, None] & mask_d[None, :]
        src = append_token[:, None] * stride_k_s + offs_d[None, :] * stride_k_d
        dst = (seq_len + append_token)[:, None] * stride_kc_s + offs_d[None, :] * stride_kc_d
        tl.store(k_cache_row_ptr + dst, tl.load(k_new_ptr + src, mask=mask_append_2d), mask=mask_append_2d)
        src = append_token[:, None] * stride_v_s + offs_d[None, :] * stride_v_d
        dst = (seq_len + append_token)[:, None] * stride_vc_s + offs_d[None, :] * stride_vc_d
        tl.store(v_cache_row_ptr + dst, tl.load(v_new_ptr + src, mask=mask_append_2d), mask=mask_append_2d)

    q_offsets = head[:, None] * stride_q_h + token[:, None] * stride_q_s + offs_d[None, :] * stride_q_d
    q = _load_tile(q_ptr + batch * stride_q_b + q_offsets, is_row_new, mask_d, True, HAS_D_MASK)
    query_pos = seq_len + token
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    is_block_live = first_token < row_new  # a block of padding rows only writes zeros

    # -- which new tokens the block sees as keys (the last split owns them) --
    new_hi = tl.where(is_block_live & (split == num_splits - 1), last_token + 1, 0)
    if not IS_CAUSAL:
        new_hi = tl.where(new_hi > 0, row_new, 0)
    if NEW_TILE > 0:
        # Decode-sized calls load the new tokens' K/V here, before the cached prefix streams, so that the load's
        # latency hides behind that loop rather than following it (NOTES.md, entry 27).
        new_cols = tl.arange(0, NEW_TILE)
        is_new_key = new_cols < new_hi
        k_new_offsets = new_cols[:, None] * stride_k_s + offs_d[None, :] * stride_k_d
        v_new_offsets = new_cols[:, None] * stride_v_s + offs_d[None, :] * stride_v_d
        k_new_tile = _load_tile(k_new_ptr + k_new_offsets, is_new_key, mask_d, True, HAS_D_MASK)
        v_new_tile = _load_tile(v_new_ptr + v_new_offsets, is_new_key, mask_d, True, HAS_D_MASK)

    # -- attend: cached prefix, no mask --
    # Every cached position precedes every new token, so the causal mask never bites here; only the tail
    # tile (length) and, with a window, the window's lower edge are masked.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    cache_lo = split * split_len
    cache_hi = tl.minimum(cache_lo + split_len, seq_len)
    if USE_WINDOW:
        cache_lo = tl.maximum(cache_lo, ((seq_len + first_token - window + 1) // BLOCK_N) * BLOCK_N)
    cache_hi = tl.where(is_block_live, cache_hi, cache_lo)
    cache_full_hi = tl.maximum(cache_lo, cache_lo + ((cache_hi - cache_lo) // BLOCK_N) * BLOCK_N)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_cache_row_ptr, v_cache_row_ptr, stride_kc_s, stride_kc_d, stride_vc_s, stride_vc_d,
        cache_lo, cache_full_hi, seq_len, 0, query_pos, qk_scale, window, offs_d, mask_d,
        BLOCK_N, HAS_D_MASK, False, False, USE_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_cache_row_ptr, v_cache_row_ptr, stride_kc_s, stride_kc_d, stride_vc_s, stride_vc_d,
        cache_full_hi, cache_hi, cache_hi, 0, query_pos, qk_scale, window, offs_d, mask_d,
        BLOCK_N, HAS_D_MASK, True, False, USE_WINDOW, DOT_PRECISION,
    )  # fmt: skip

    # -- attend: new tokens, straight from key/value --
    if NEW_TILE > 0:
        acc, m_i, l_i = _attend_loaded_tile(
            acc, m_i, l_i, q, k_new_tile, v_new_tile, new_cols, is_new_key, seq_len, query_pos, qk_scale, window,
            IS_CAUSAL, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip
    else:
        if IS_CAUSAL:
            # Keys before the block's first token are visible to all its rows: no mask off the diagonal band.
            band_lo = tl.minimum((first_token // BLOCK_N) * BLOCK_N, new_hi)
        else:
            band_lo = (new_hi // BLOCK_N) * BLOCK_N
        new_lo = 0
        if USE_WINDOW:
            new_lo = tl.minimum(tl.maximum(0, ((first_token - window + 1) // BLOCK_N) * BLOCK_N), band_lo)
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_new_ptr, v_new_ptr, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
            new_lo, band_lo, row_new, seq_len, query_pos, qk_scale, window, offs_d, mask_d,
            BLOCK_N, HAS_D_MASK, False, False, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_new_ptr, v_new_ptr, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
            band_lo, new_hi, new_hi, seq_len, query_pos, qk_scale, window, offs_d, mask_d,
            BLOCK_N, HAS_D_MASK, True, IS_CAUSAL, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip

    # -- epilogue --
    # Rows past query_lens, and rows that saw no key at all (an empty split), produce exactly 0.
    has_keys = is_row_new & (l_i > 0.0)
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    mask_out = is_row_in_grid[:, None] & mask_d[None, :]
    row_index = (batch * num_kv_heads * GROUP + head) * num_new + token  # flat (batch, q head, token)
    out_ptrs = out_ptr + row_index[:, None] * HEAD_DIM + offs_d[None, :]
    if USE_SPLIT_KV:
        partial_rows = row_index * num_splits + split
        tl.store(partial_out_ptr + partial_rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_out)
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial_rows, lse, mask=is_row_in_grid)
        if USE_LAST_SPLIT_MERGE:
            # -- merge: the last split of the tile to finish combines all of them --
            # The barrier puts every warp's partial stores before the ticket, whose release then publishes
            # them; the last taker's acquire makes all splits' partials visible to its loads.
            tl.debug_barrier()
            tile_ticket_ptr = tile_tickets_ptr + pid_bh * num_m_blocks + pid_m
            if tl.atomic_add(tile_ticket_ptr, 1, sem="acq_rel") == num_splits - 1:
                tl.atomic_xchg(tile_ticket_ptr, 0)
                packed_rows_in_grid = num_new * GROUP
                merge_end = tl.minimum(pid_m * BLOCK_M + BLOCK_M, packed_rows_in_grid)
                for merge_start in range(pid_m * BLOCK_M, merge_end, MERGE_ROWS):
                    offs_merge = merge_start + tl.arange(0, MERGE_ROWS)
                    merge_token = offs_merge // GROUP
                    merge_head = kv_head * GROUP + offs_merge % GROUP
                    merge_rows = (batch * num_kv_heads * GROUP + merge_head) * num_new + merge_token
                    _merge_kv_splits(
                        partial_out_ptr, partial_lse_ptr, out_ptr, merge_rows, offs_merge < packed_rows_in_grid,
                        num_splits, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD, MERGE_ROWS,
                    )  # fmt: skip
                _advance_seq_lens_after_last_tile(
                    seq_lens_ptr, row_tickets_ptr, batch, seq_len_before + row_new, num_m_blocks * num_kv_heads
                )
        else:
            # The merge launch that follows writes out; the row's seq_lens is advanced here, by its last program.
            _advance_seq_lens_after_last_tile(
                seq_lens_ptr, row_tickets_ptr, batch, seq_len_before + row_new, num_m_blocks * num_kv_heads * num_splits
            )
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_out)
        _advance_seq_lens_after_last_tile(
            seq_lens_ptr, row_tickets_ptr, batch, seq_len_before + row_new, num_m_blocks * num_kv_heads
        )


_launch_attention = CachedLauncher(_attention_with_kv_cache_kernel)


@dataclass(frozen=True)
class _LaunchPlan:
    config: configs.AttentionConfig
    num_m_blocks: int
    num_splits: int
    rows_per_group: int
    head_dim_pad: int  # HEAD_DIM_PAD
    splits_pad: int  # SPLITS_PAD
    merge_rows: int  # MERGE_ROWS


@functools.cache
def _launch_plan(
    packed_rows: int, head_dim: int, batch_kv_heads: int, capacity: int, element_bytes: int, device: torch.device
) -> _LaunchPlan:
    """Config, M blocks, KV splits and launch-order groups depend on shapes only, so they are computed once per
    shape (and so is every ``triton.next_power_of_2``: on triton 3.9 one call per launch cost measurable host
    time, NOTES.md entry 23)."""
    config = configs.attention_config(packed_rows, head_dim, batch_kv_heads, element_bytes, device)
    num_m_blocks = triton.cdiv(packed_rows, config.block_m)
    num_splits = configs.num_kv_splits(num_m_blocks * batch_kv_heads, capacity, device, config.kv_splits)
    rows_per_group = configs.rows_per_launch_group(
        batch_kv_heads, num_m_blocks, capacity, head_dim, element_bytes, device
    )
    head_dim_pad = configs.head_dim_padded(head_dim)
    splits_pad = triton.next_power_of_2(num_splits)
    merge_rows = configs.merge_rows(packed_rows, config.block_m, splits_pad, head_dim_pad)
    return _LaunchPlan(config, num_m_blocks, num_splits, rows_per_group, head_dim_pad, splits_pad, merge_rows)


def supports(call: KernelCall) -> bool:
    """Every validated call: this is the portable kernel (CUDA, or the CPU under the interpreter)."""
    return True


def run(call: KernelCall) -> torch.Tensor:
    """One launch (append, attention, split merge, seq_lens update); a split prefix merged in a second launch
    (which leaves seq_lens to this one) under graph capture (``split_merge.merges_in_attention_launch``)."""
    query, key, value, k_cache, v_cache, seq_lens, query_lens, is_causal, scale, sliding_window = call
    batch, num_q_heads, num_new, head_dim = query.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if batch == 0 or num_new == 0:
        return out
    plan = _launch_plan(num_new * group, head_dim, batch * num_kv_heads, capacity, k_cache.element_size(), query.device)
    config, num_m_blocks, num_splits = plan.config, plan.num_m_blocks, plan.num_splits
    row_tickets = scratch_buffer("row_tickets", batch, torch.int32, query.device)
    use_last_split_merge = False
    if num_splits > 1:
        partial_out, partial_lse = split_partials(batch * num_q_heads * num_new, num_splits, head_dim, query.device)
        use_last_split_merge = split_merge.merges_in_attention_launch(query.device)
    else:
        partial_out = partial_lse = out  # unused without USE_SPLIT_KV
    if use_last_split_merge:
        tile_tickets = scratch_buffer("tile_tickets", num_m_blocks * batch * num_kv_heads, torch.int32, query.device)
    else:
        tile_tickets = row_tickets  # unused

    use_pdl = uses_programmatic_launch(query.device)
    _launch_attention(
        (batch * num_kv_heads, num_m_blocks, num_splits),
        (
            query, key, value, k_cache, v_cache, seq_lens, query_lens if query_lens is not None else seq_lens,
            out, partial_out, partial_lse, row_tickets, tile_tickets,
            *query.stride(), *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
            num_kv_heads, num_new, capacity, plan.rows_per_group, scale * configs.LOG2_E, sliding_window,
        ),
        dict(
            GROUP=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=plan.head_dim_pad,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            IS_CAUSAL=is_causal,
            USE_WINDOW=sliding_window > 0,
            HAS_QUERY_LENS=query_lens is not None,
            USE_SPLIT_KV=num_splits > 1,
            USE_LAST_SPLIT_MERGE=use_last_split_merge,
            SPLITS_PAD=plan.splits_pad,
            MERGE_ROWS=plan.merge_rows,
            USE_PDL=use_pdl,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            NEW_TILE=configs.new_tokens_tile(num_new),
        ),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=use_pdl,
    )  # fmt: skip
    if num_splits > 1 and not use_last_split_merge:
        split_merge.merge_kv_splits(partial_out, partial_lse, out, seq_lens)
    return out
