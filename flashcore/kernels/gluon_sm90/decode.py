"""Warp-specialised decode for Hopper: one producer warp streams K/V with TMA while four warps attend.

Semantics are :func:`flashcore.ops.attention_with_kv_cache`'s, for the calls this kernel takes: one new token
per row (``S_q == 1``; ``query_lens`` may mark a row as padding), no window, fp16/bf16, ``D`` 64 or 128,
``H_q // H_kv <= 16``, caches in a layout ``common.cache_tile_grid`` takes, on an sm_90 GPU. :func:`supports`
says whether a call is one of them; ops.py hands each of them over, eager or captured into a CUDA graph, so that a
graph-replayed decode step gives the eager one's bits.

Why a second decode kernel, in Gluon rather than Triton: at decode the K/V stream is the whole cost, and the
Triton kernel's software pipeline keeps a block barrier at every stage handoff, so its loads are issued late
(benchmarks/NOTES.md, entries 26-28). Triton 3.6 does not warp-specialise that loop. Here the roles are split by
hand, FA3/FlashInfer style: the producer waits only for a stage to be ``empty`` and issues its TMA copies; the
consumers wait only for it to be ``ready``. The producer also takes the row's ``seq_lens`` ticket, so the
consumers' tail is the output store. H100, graph replay, same run: faster than the Triton kernel or level with
it on each of 20 decode rows of bench_attention, most on the short ones such as B1 L1k (NOTES.md, entry 30).

Grid ``(B * H_kv, KV splits)``, GQA packed as in the Triton kernel: one program attends the ``GROUP`` query heads
of one KV head, padded to a 16-row mma.sync tile. The cached prefix ``[0, L_b)`` is split into equal runs of key
tiles; split 0 appends the new token's K/V at ``L_b``, the last split attends to it from ``key``/``value``. The
splits are merged where the Triton kernel merges its own (``triton/split_merge.py``): eagerly, by the last split of
each (batch, KV head) to finish, in this launch, since a second launch would double the host time, which is an eager
call's cost; under capture, by the Triton merge launch. Both give the same bits. Either way this launch advances
``seq_lens``, by the row's last program to take its ticket.

Under programmatic dependent launch the producer issues its first copies before the wait for the previous kernel:
only ``q`` and the new token's K/V come from that kernel (see the kernel's comment).
"""

from __future__ import annotations

import functools

import torch
import triton

from flashcore.kernels import configs
from flashcore.kernels.call import KernelCall
from flashcore.kernels.gluon_sm90 import common
from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch
from flashcore.kernels.scratch import scratch_buffer, split_partials
from flashcore.kernels.triton import split_merge

if common.HAS_GLUON:
    from flashcore.kernels.gluon_sm90.common import (
        advance_seq_lens_after_last_program,
        cached_tile_descriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        merge_kv_splits,
        mma_v2,
        online_softmax_step,
        partition_barrier,
        tma_load,
    )

NAME = "gluon_sm90.decode"
CONFIG = configs.GLUON_DECODE


def supports(call: KernelCall) -> bool:
    """Whether this kernel can run a (validated) call: see the module docstring for the list."""
    query, key, value = call.query, call.key, call.value
    if query.shape[2] != 1:  # first: ops asks on every call
        return False
    group = query.shape[1] // key.shape[1]
    return (
        group <= CONFIG.block_m
        and query.stride(3) == key.stride(3) == value.stride(3) == 1
        and common.streams_cache(call, CONFIG.head_dims)
    )


if common.HAS_GLUON:
    _PRODUCER_REGISTERS = gl.constexpr(24)  # the least a warp can hold; the producer only computes addresses

    @gluon.jit
    def _stream_kv_tiles(
        k_desc, v_desc, k_tiles, v_tiles, ready, empty, seq_lens_ptr, row_tickets_ptr,
        batch, new_seq_len, row_base, col, lo, num_tiles, num_row_programs,
        ADVANCE_SEQ_LENS: gl.constexpr, BLOCK_N: gl.constexpr, WAIT_IN_PARTITIONS: gl.constexpr,
    ):  # fmt: skip
        """The producer warp: fills the stages in turn, each as soon as the consumers hand it back."""
        NUM_STAGES: gl.constexpr = k_tiles.type.shape[0]
        for i in range(num_tiles):
            stage = i % NUM_STAGES
            # mbarriers start in phase 1 complete, so the first pass over the stages does not wait.
            mbarrier.wait(empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            row = row_base + lo + i * BLOCK_N
            tma_load(k_desc, [row, col], ready.index(stage), k_tiles.index(stage))
            tma_load(v_desc, [row, col], ready.index(stage), v_tiles.index(stage))
        if ADVANCE_SEQ_LENS:
            # Taken after the last copy is issued, while the consumers work through the last stages. Only the
            # consumer warps read seq_lens (worker warps idle until their partition starts), and stage 0's first
            # hand-back means every one of them is past that read.
            if num_tiles <= NUM_STAGES:
                mbarrier.wait(empty.index(0), 0)
            if WAIT_IN_PARTITIONS:  # the previous kernel has finished with every seq_lens before this one writes one
                common.wait_for_previous_grid()
            advance_seq_lens_after_last_program(seq_lens_ptr, row_tickets_ptr, batch, new_seq_len, num_row_programs)

    @gluon.jit
    def _attend_kv_tiles(
        q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
        seq_lens_ptr, row_tickets_ptr, tile_tickets_ptr, k_tiles, v_tiles, ready, empty,
        stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
        batch, kv_head, split, num_splits, seq_len, row_new, new_seq_len, lo, hi, num_tiles, row_base, col,
        row_stride, num_kv_heads, capacity, qk_scale,
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        USE_SPLIT_KV: gl.constexpr, MERGE_IN_LAUNCH: gl.constexpr, SPLITS_PAD: gl.constexpr,
        MERGE_ROWS: gl.constexpr, ADVANCE_SEQ_LENS: gl.constexpr, NUM_WARPS: gl.constexpr,
        WAIT_IN_PARTITIONS: gl.constexpr, RELEASE_AFTER_WAIT: gl.constexpr,
    ):  # fmt: skip
        """The consumer warps: online softmax over the stages as they land, then the epilogue."""
        if WAIT_IN_PARTITIONS:
            # While the producer's first copies are in flight: q and the new K/V are the previous kernel's outputs.
            common.wait_for_previous_grid()
            if RELEASE_AFTER_WAIT:
                common.launch_dependents()
        NUM_STAGES: gl.constexpr = k_tiles.type.shape[0]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
        a_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        rows: gl.constexpr = gl.SliceLayout(1, mma)
        cols: gl.constexpr = gl.SliceLayout(0, mma)
        tail_tile: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        dtype = k_tiles.dtype

        # -- row metadata --
        offs_m = gl.arange(0, BLOCK_M, layout=rows)
        offs_d = gl.arange(0, HEAD_DIM, layout=cols)
        offs_n = gl.arange(0, BLOCK_N, layout=cols)
        mask_m = offs_m < GROUP
        head = kv_head * GROUP + offs_m
        q_offsets = batch.to(gl.int64) * stride_q_b + head[:, None] * stride_q_h + offs_d[None, :]
        q = gl.load(q_ptr + q_offsets, mask=mask_m[:, None], other=0.0)
        q_operand = gl.convert_layout(q, a_operand)
        # The new token's K/V is loaded here, so that its latency hides behind the first copies, not at the tail.
        k_new = gl.load(k_ptr + batch.to(gl.int64) * stride_k_b + kv_head * stride_k_h + offs_d)
        v_new = gl.load(v_ptr + batch.to(gl.int64) * stride_v_b + kv_head * stride_v_h + offs_d)

        # -- append new K/V --
        # Into [seq_len, seq_len + 1), which no split reads as a key (a tail copy may cover it: masked below).
        if split == 0:
            # A row already at capacity (only with check=False) stores nothing: tokens past capacity are dropped.
            mask_append = (offs_d < HEAD_DIM) & (seq_len < capacity) & (row_new > 0)
            append_offsets = (row_base + seq_len).to(gl.int64) * row_stride + col + offs_d
            gl.store(k_cache_ptr + append_offsets, k_new, mask=mask_append)
            gl.store(v_cache_ptr + append_offsets, v_new, mask=mask_append)
        if ADVANCE_SEQ_LENS:
            if num_tiles == 0:  # no stage will come back to the producer: hand stage 0 back now
                partition_barrier()
                mbarrier.arrive(empty.index(0), count=1)

        # -- attend: cached prefix --
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows)
        l_i = gl.zeros([BLOCK_M], gl.float32, rows)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, mma)
        zero_scores = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        num_full_tiles = (hi - lo) // BLOCK_N
        for i in range(num_tiles):
            stage = i % NUM_STAGES
            mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
            k = k_tiles.index(stage).permute((1, 0)).load(b_operand)
            if i < num_full_tiles:
                v = v_tiles.index(stage).load(b_operand)
            else:
                # The tail copy runs past seq_len into garbage (maybe NaN): p is 0 there, but 0 * NaN is not.
                tail_keys = lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, tail_tile))
                v = v_tiles.index(stage).load(tail_tile)
                v = gl.convert_layout(gl.where((tail_keys < hi)[:, None], v, gl.zeros_like(v)), b_operand)
            # Every warp's shared-memory reads of the stage come before the producer's next copy into it.
            partition_barrier()
            fence_async_shared()
            mbarrier.arrive(empty.index(stage), count=1)
            scores = mma_v2(q_operand, k, zero_scores)
            scores = gl.where((lo + i * BLOCK_N + offs_n < hi)[None, :], scores, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i, qk_scale)
            acc = mma_v2(gl.convert_layout(p.to(dtype), a_operand), v, acc * alpha[:, None])

        # -- attend: the new token (the last split owns it; a padding row has none) --
        if (split == num_splits - 1) & (row_new > 0):
            score_new = gl.sum(q.to(gl.float32) * k_new.to(gl.float32)[None, :], 1) * qk_scale
            m_new = gl.maximum(m_i, score_new)
            p_new = gl.exp2(score_new - m_new)
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + p_new
            m_i = m_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(gl.float32)[None, :]

        # -- epilogue --
        # A split that saw no key produces exactly 0 and an LSE of -inf, which the merge weighs as nothing.
        has_keys = mask_m & (l_i > 0.0)
        out = gl.where(has_keys[:, None], acc / gl.where(has_keys, l_i, 1.0)[:, None], 0.0)
        first_out_row = batch * num_kv_heads * GROUP + kv_head * GROUP  # flat (batch, q head): one token per row
        out_rows = first_out_row + offs_m
        if USE_SPLIT_KV:
            partial_rows = out_rows * num_splits + split
            partial_offsets = partial_rows[:, None] * HEAD_DIM + offs_d[None, :]
            gl.store(partial_out_ptr + partial_offsets, out, mask=mask_m[:, None])
            lse = gl.where(has_keys, m_i + gl.log2(gl.where(has_keys, l_i, 1.0)), float("-inf"))
            gl.store(partial_lse_ptr + partial_rows, lse, mask=mask_m)
            if MERGE_IN_LAUNCH:
                # -- merge: the last split of the (batch, KV head) to finish combines all of them --
                # The barrier puts every consumer warp's partial stores before the ticket, whose release then
                # publishes them; the last taker's acquire makes all splits' partials visible to its loads.
                # Only these warps ever read seq_lens (worker warps idle outside their partition), so the last
                # merge of the row may advance it.
                partition_barrier()
                tile_ticket_ptr = tile_tickets_ptr + batch * num_kv_heads + kv_head
                if gl.atomic_add(tile_ticket_ptr, 1, sem="acq_rel") == num_splits - 1:
                    gl.atomic_xchg(tile_ticket_ptr, 0)
                    for merge_start in range(0, GROUP, MERGE_ROWS):
                        merge_kv_splits(
                            partial_out_ptr, partial_lse_ptr, out_ptr, first_out_row + merge_start,
                            GROUP - merge_start, num_splits, HEAD_DIM, SPLITS_PAD, MERGE_ROWS, NUM_WARPS,
                        )  # fmt: skip
                    advance_seq_lens_after_last_program(seq_lens_ptr, row_tickets_ptr, batch, new_seq_len, num_kv_heads)
        else:
            out_offsets = out_rows[:, None] * HEAD_DIM + offs_d[None, :]
            gl.store(out_ptr + out_offsets, out.to(dtype), mask=mask_m[:, None])

    @gluon.jit
    def _warp_specialized_decode_kernel(
        q_ptr,  # [B, H_q, 1, D], stride 1 along D
        k_ptr,  # [B, H_kv, 1, D]: the new token's key
        v_ptr,  # [B, H_kv, 1, D]
        k_cache_ptr,  # [B, H_kv, S_max, D], a layout common.cache_tile_grid takes: the append's target
        v_cache_ptr,
        k_desc,  # TMA descriptor over k_cache seen as common.CacheTileGrid's 2D view, [BLOCK_N, D] boxes
        v_desc,
        seq_lens_ptr,  # [B] int32
        query_lens_ptr,  # [B] int32, HAS_QUERY_LENS only: 1 for a new token, 0 for a padding row
        row_tickets_ptr,  # [B] int32, zero between calls: the row's last program resets it
        tile_tickets_ptr,  # MERGE_IN_LAUNCH only: [B * H_kv] int32, zero between calls (the last split resets it)
        out_ptr,  # [B, H_q, 1, D], contiguous
        partial_out_ptr,  # USE_SPLIT_KV only: [B * H_q, splits, D] fp32
        partial_lse_ptr,  # USE_SPLIT_KV only: [B * H_q, splits] fp32
        stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
        row_stride, rows_per_batch, rows_per_head, cols_per_head,  # the caches' CacheTileGrid (cols, then the rest)
        num_kv_heads,
        capacity,  # S_max
        qk_scale,  # softmax scale * log2(e)
        GROUP: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        HAS_QUERY_LENS: gl.constexpr,
        USE_SPLIT_KV: gl.constexpr,  # else one program per (batch, KV head) row, which advances seq_lens itself
        MERGE_IN_LAUNCH: gl.constexpr,  # with USE_SPLIT_KV: the last split merges (else the Triton merge launch)
        SPLITS_PAD: gl.constexpr,  # MERGE_IN_LAUNCH only: splits, rounded up to a power of two
        MERGE_ROWS: gl.constexpr,  # MERGE_IN_LAUNCH only: query heads merged per step (bounds its registers)
        USE_PDL: gl.constexpr,  # launched with programmatic dependent launch (launch.uses_programmatic_launch)
        NUM_WARPS: gl.constexpr,  # the consumer warps (the kernel's num_warps)
        WAIT_FIRST: gl.constexpr,  # with USE_PDL: wait before reading the cache (split_merge.follows_merge_of)
        RELEASE_AFTER_WAIT: gl.constexpr,  # with USE_PDL: release the next kernel right after the wait
    ):  # fmt: skip
        # -- programmatic dependent launch --
        # This launch may start while the previous kernel (a model's q/k/v projection) still runs. Everything up to
        # the consumers' loads of q and the new K/V reads what that kernel cannot be writing: seq_lens, query_lens
        # and the cached prefix, written by this cache's attention launches and by kernels launched without PDL,
        # which finish before the next kernel starts. So the producer's first copies go out before the wait, which
        # only the consumer warps take, before those loads (benchmarks/NOTES.md, entry 59); the producer waits before
        # it writes seq_lens. One exception: right after this cache's own split merge, which releases the next kernel
        # before its attention launch is done, the whole launch waits first (WAIT_FIRST).
        WAIT_IN_PARTITIONS: gl.constexpr = USE_PDL and not WAIT_FIRST
        if USE_PDL and WAIT_FIRST:
            common.wait_for_previous_grid()
            if RELEASE_AFTER_WAIT:
                common.launch_dependents()
        # -- row metadata --
        pid_bh = gl.program_id(0)
        split = gl.program_id(1)
        num_splits = gl.num_programs(1)
        batch = pid_bh // num_kv_heads
        kv_head = pid_bh % num_kv_heads
        # With check=False seq_lens may be negative or at capacity; reads and writes stay inside the cache.
        seq_len_before = gl.load(seq_lens_ptr + batch)
        seq_len = gl.minimum(gl.maximum(seq_len_before, 0), capacity)
        if HAS_QUERY_LENS:
            row_new = gl.minimum(gl.maximum(gl.load(query_lens_ptr + batch), 0), 1)
        else:
            row_new = 1
        split_len = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        lo = gl.minimum(split * split_len, seq_len)
        hi = lo + (gl.minimum(lo + split_len, seq_len) - lo) * row_new  # a padding row reads nothing: its output is 0
        num_tiles = gl.cdiv(hi - lo, BLOCK_N)
        row_base = batch * rows_per_batch + kv_head * rows_per_head
        col = kv_head * cols_per_head

        k_tiles = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_tiles = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(stage), count=1)
            mbarrier.init(empty.index(stage), count=1)

        # Every program of the row takes the seq_lens ticket, unless the splits merge in this launch, where the last
        # split of each KV head takes it once it has merged.
        ADVANCE_SEQ_LENS: gl.constexpr = not MERGE_IN_LAUNCH
        gl.warp_specialize(
            [
                (
                    _attend_kv_tiles,
                    (
                        q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
                        seq_lens_ptr, row_tickets_ptr, tile_tickets_ptr, k_tiles, v_tiles, ready, empty,
                        stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
                        batch, kv_head, split, num_splits, seq_len, row_new, seq_len_before + row_new, lo, hi,
                        num_tiles, row_base, col, row_stride, num_kv_heads, capacity, qk_scale,
                        GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, USE_SPLIT_KV, MERGE_IN_LAUNCH, SPLITS_PAD, MERGE_ROWS,
                        ADVANCE_SEQ_LENS, NUM_WARPS, WAIT_IN_PARTITIONS, RELEASE_AFTER_WAIT,
                    ),
                ),
                (
                    _stream_kv_tiles,
                    (
                        k_desc, v_desc, k_tiles, v_tiles, ready, empty, seq_lens_ptr, row_tickets_ptr,
                        batch, seq_len_before + row_new, row_base, col, lo, num_tiles, num_kv_heads * num_splits,
                        ADVANCE_SEQ_LENS, BLOCK_N, WAIT_IN_PARTITIONS,
                    ),
                ),
            ],
            [1],
            [_PRODUCER_REGISTERS],
        )  # fmt: skip

    _launch_decode = CachedLauncher(_warp_specialized_decode_kernel)


@functools.cache
def _launch_plan(batch_kv_heads: int, capacity: int, group: int, head_dim: int, device: torch.device) -> tuple:
    """Keys per tile, KV splits, their power-of-two padding and the merge's rows per step: per shape, computed
    once (host time)."""
    num_splits = configs.gluon_decode_kv_splits(batch_kv_heads, capacity, device)
    block_n = configs.gluon_decode_block_n(head_dim, batch_kv_heads, num_splits, capacity, device)
    splits_pad = triton.next_power_of_2(num_splits)
    return block_n, num_splits, splits_pad, configs.merge_rows(group, CONFIG.block_m, splits_pad, head_dim)


# An eager call's bound launch (launch.BoundLaunch), per call shape and cache: the host time of an eager decode call
# is its cost (NOTES.md, entry 40). The key is everything the launch's arguments depend on besides the addresses of
# the per-call tensors (q, k, v, seq_lens, query_lens, out), the positions of which are _VARYING.

MAX_BOUND_LAUNCHES = 4096  # per live cache two layers' worth each; a new cache adds its own
_bound_launches: dict[tuple, object] = {}
_VARYING = (0, 1, 2, 7, 8, 11)


def forget_launch_plans() -> None:
    """Drops the cached launch plans and bound launches (for tests that change what a plan is computed from)."""
    _launch_plan.cache_clear()
    _bound_launches.clear()


def run(call: KernelCall) -> torch.Tensor:
    """Append-and-attend for a call that :func:`supports` accepts, in one launch; with KV splits under graph
    capture, the Triton merge launch follows (where splits merge: ``split_merge.merges_in_attention_launch``).

    An eager call repeats an earlier one's launch through its :class:`~flashcore.kernels.launch.BoundLaunch` where
    there is one: the same kernel, arguments and grid as below, without deriving them again."""
    query, key, value, k_cache, v_cache, seq_lens, query_lens, _, scale, _ = call
    out = query.new_empty(query.shape)  # contiguous; less host time than torch.empty (NOTES.md, entry 35)
    if query.shape[0] == 0:
        return out
    merge_in_launch = split_merge.merges_in_attention_launch(query.device)
    wait_first = split_merge.follows_merge_of(seq_lens)  # then no bound launch: those are bound without the wait
    bound_key = None
    if merge_in_launch and not wait_first:  # eager (a bound launch made while capturing could hold its scratch)
        bound_key = (
            query.shape, query.stride(), key.stride(), value.stride(), query.dtype, query.device, k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.shape, k_cache.stride(), query_lens is None, scale,
        )  # fmt: skip
        bound = _bound_launches.get(bound_key)
        lens = seq_lens if query_lens is None else query_lens
        if bound is not None and bound.launch(
            query.data_ptr(), key.data_ptr(), value.data_ptr(), seq_lens.data_ptr(), lens.data_ptr(), out.data_ptr()
        ):
            return out
    _launch(call, out, merge_in_launch, wait_first, bound_key)
    return out


def _launch(
    call: KernelCall, out: torch.Tensor, merge_in_launch: bool, wait_first: bool, bound_key: tuple | None
) -> None:
    query, key, value, k_cache, v_cache, seq_lens, query_lens, _, scale, _ = call
    batch, num_q_heads, _, head_dim = query.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_n, num_splits, splits_pad, merge_rows = _launch_plan(
        batch * num_kv_heads, capacity, group, head_dim, query.device
    )
    row_tickets = scratch_buffer("row_tickets", batch, torch.int32, query.device)
    tile_tickets = row_tickets  # unused without MERGE_IN_LAUNCH
    if num_splits > 1:
        partial_out, partial_lse = split_partials(batch * num_q_heads, num_splits, head_dim, query.device)
        if merge_in_launch:
            tile_tickets = scratch_buffer("tile_tickets", batch * num_kv_heads, torch.int32, query.device)
    else:
        merge_in_launch = False
        partial_out = partial_lse = out  # unused without USE_SPLIT_KV
    use_pdl = uses_programmatic_launch(query.device)
    # One stride() per tensor: six stride(i) calls cost more host time (NOTES.md, entry 35).
    stride_q, stride_k, stride_v = query.stride(), key.stride(), value.stride()
    k_desc, grid = cached_tile_descriptor(k_cache, block_n)
    v_desc = cached_tile_descriptor(v_cache, block_n)[0]  # the same grid: supports() checked the strides
    launch_grid = (batch * num_kv_heads, num_splits, 1)
    args = (
        query, key, value, k_cache, v_cache,
        k_desc, v_desc,
        seq_lens, query_lens if query_lens is not None else seq_lens, row_tickets, tile_tickets,
        out, partial_out, partial_lse,
        stride_q[0], stride_q[1], stride_k[0], stride_k[1], stride_v[0], stride_v[1],
        grid.cols, grid.rows_per_batch, grid.rows_per_head, grid.cols_per_head, num_kv_heads, capacity,
        scale * configs.LOG2_E,
    )  # fmt: skip
    constexprs = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=CONFIG.block_m,
        BLOCK_N=block_n,
        NUM_STAGES=CONFIG.num_stages,
        HAS_QUERY_LENS=query_lens is not None,
        USE_SPLIT_KV=num_splits > 1,
        MERGE_IN_LAUNCH=merge_in_launch,
        SPLITS_PAD=splits_pad,
        MERGE_ROWS=merge_rows,
        USE_PDL=use_pdl,
        NUM_WARPS=CONFIG.num_consumer_warps,
        WAIT_FIRST=wait_first,
        # Released right after the wait, as the other kernels release theirs, so that a model's o projection streams
        # its weight during the attention (NOTES.md, entry 75); a merge in the launch ends the attention only after it.
        RELEASE_AFTER_WAIT=num_splits == 1 or not merge_in_launch,
    )
    options = dict(
        num_warps=CONFIG.num_consumer_warps, num_stages=CONFIG.num_stages, launch_pdl=use_pdl,
        maxnreg=CONFIG.max_registers,
    )  # fmt: skip
    _launch_decode(launch_grid, args, constexprs, **options)
    if num_splits > 1 and not merge_in_launch:
        split_merge.merge_kv_splits(partial_out, partial_lse, out, seq_lens)
    if bound_key is not None:
        bound = _launch_decode.bind(launch_grid, args, constexprs, varying=_VARYING, **options)
        if bound is not None:
            if len(_bound_launches) >= MAX_BOUND_LAUNCHES:
                _bound_launches.clear()
            _bound_launches[bound_key] = bound
