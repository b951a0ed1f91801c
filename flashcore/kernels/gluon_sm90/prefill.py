"""Warp-specialised causal prefill for Hopper: a TMA producer warp and two consumer warpgroups that never wait
for each other.

Semantics are :func:`flashcore.ops.attention_with_kv_cache`'s, for the calls this kernel takes: causal, at least
``configs.GLUON_PREFILL.min_new_tokens`` new tokens per row and no ``query_lens`` (every row appends ``S_q``), no
window, fp16/bf16, ``D`` in ``configs.GLUON_PREFILL.head_dims``, contiguous q/k/v, caches in a layout
``common.cache_tile_grid`` takes, on an sm_90 GPU. :func:`supports` says whether a call is one of them.

Why: the Triton kernel's two warpgroups run their softmax and their MMAs in lockstep behind block barriers, so the
tensor cores idle while the softmax runs (NOTES.md, entries 9 and 26). FA3 splits a program's 128 query rows
between two consumer warpgroups and a producer; here each consumer runs its own online softmax with wgmma, and
with no barrier between them one's softmax overlaps the other's MMAs. H100, B1, 32/8 heads, S 2k-16k: faster
than the Triton kernel at every length and close to SDPA, though still behind it (NOTES.md, entry 30).

Grid ``(B * H_q, ceil(S_q / 128))``, heaviest query blocks first (the Triton kernel's launch order). Keys are the
cached prefix ``[0, L_b)`` (cache tiles) then the new tokens (key/value tiles, causal on the diagonal). The programs
of one KV head's first query head append the new K/V; the producer warps take a per-row ticket and the last
advances ``seq_lens``.
"""

from __future__ import annotations

import torch

from flashcore.kernels import configs
from flashcore.kernels.call import KernelCall
from flashcore.kernels.gluon_sm90 import common
from flashcore.kernels.launch import CachedLauncher
from flashcore.kernels.scratch import scratch_buffer

if common.HAS_GLUON:
    from flashcore.kernels.gluon_sm90.common import (
        advance_seq_lens_after_last_program,
        cached_tile_descriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        online_softmax_step,
        partition_barrier,
        tile_descriptor,
        tma_load,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

NAME = "gluon_sm90.prefill"
CONFIG = configs.GLUON_PREFILL


def supports(call: KernelCall) -> bool:
    """Whether this kernel can run a (validated) call: see the module docstring for the list."""
    query, key, value = call.query, call.key, call.value
    batch, num_q_heads, num_new, _ = query.shape
    if num_new < CONFIG.min_new_tokens:  # first: ops asks on every call, decode steps included
        return False
    return (
        call.is_causal
        and call.query_lens is None
        and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (query, key, value))
        and batch * num_q_heads * num_new < 2**31  # TMA coordinates are int32
        and common.streams_cache(call, CONFIG.head_dims)
    )


if common.HAS_GLUON:
    _CONSUMER_REGISTERS = gl.constexpr(232)
    _PRODUCER_REGISTERS = gl.constexpr(24)
    _COPY_ROWS = gl.constexpr(32)  # rows per register round trip in the append and the tail fix

    @gluon.jit
    def _stream_tiles(args, HALF: gl.constexpr):
        """The producer warp: Q once, then the cache tiles and the new tokens' tiles through the stages.

        Every partition takes ``(args, HALF)``: Gluon's worker partitions share one signature. HALF is unused here.
        """
        (q_desc, k_desc, v_desc, k_cache_desc, v_cache_desc, q_smem, k_tiles, v_tiles, q_ready, ready, empty,
         tail_fixed, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seq_lens_ptr, row_tickets_ptr,
         batch, seq_len_before, seq_len, num_new, capacity, q_row, new_row, cache_row, cache_col, cache_row_stride,
         m0, num_cache_tiles, num_tiles, num_row_programs, is_appender, qk_scale, out_base,
         out_token_stride) = args  # fmt: skip
        HALF_M: gl.constexpr = q_smem.type.shape[1]
        TILE_N: gl.constexpr = k_tiles.type.shape[1]
        STAGES: gl.constexpr = k_tiles.type.shape[0]
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        tma_load(q_desc, [q_row, 0], q_ready, q_smem.index(0))
        tma_load(q_desc, [q_row + HALF_M, 0], q_ready, q_smem.index(1))
        for i in range(num_tiles):
            stage = i % STAGES
            # mbarriers start in phase 1 complete, so the first pass over the stages does not wait.
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            if i < num_cache_tiles:
                tma_load(k_cache_desc, [cache_row + i * TILE_N, cache_col], ready.index(stage), k_tiles.index(stage))
                tma_load(v_cache_desc, [cache_row + i * TILE_N, cache_col], ready.index(stage), v_tiles.index(stage))
            else:
                row = new_row + (i - num_cache_tiles) * TILE_N
                tma_load(k_desc, [row, 0], ready.index(stage), k_tiles.index(stage))
                tma_load(v_desc, [row, 0], ready.index(stage), v_tiles.index(stage))
        # Stage 0's first hand-back means both consumers are past their read of seq_lens.
        if num_tiles <= STAGES:
            mbarrier.wait(empty.index(0), 0)
        advance_seq_lens_after_last_program(
            seq_lens_ptr, row_tickets_ptr, batch, seq_len_before + num_new, num_row_programs
        )

    @gluon.jit
    def _attend_half(args, HALF: gl.constexpr):
        """One consumer warpgroup: query rows [m0 + 64 * HALF, + 64) against every key tile, then the epilogue."""
        (q_desc, k_desc, v_desc, k_cache_desc, v_cache_desc, q_smem, k_tiles, v_tiles, q_ready, ready, empty,
         tail_fixed, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seq_lens_ptr, row_tickets_ptr,
         batch, seq_len_before, seq_len, num_new, capacity, q_row, new_row, cache_row, cache_col, cache_row_stride,
         m0, num_cache_tiles, num_tiles, num_row_programs, is_appender, qk_scale, out_base,
         out_token_stride) = args  # fmt: skip
        HALF_M: gl.constexpr = q_smem.type.shape[1]
        D: gl.constexpr = q_smem.type.shape[2]
        TILE_N: gl.constexpr = k_tiles.type.shape[1]
        STAGES: gl.constexpr = k_tiles.type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, TILE_N, 16])  # fmt: skip
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])  # fmt: skip
        p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_copy: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        dtype = k_tiles.dtype
        first_row = m0 + HALF * HALF_M

        # -- append new K/V --
        # Rows [first_row, + 64) of the new tokens, by the programs of each KV head's first query head.
        offs_copy = gl.arange(0, _COPY_ROWS, layout=gl.SliceLayout(1, rows_copy))
        offs_d_copy = gl.arange(0, D, layout=gl.SliceLayout(0, rows_copy))
        if is_appender:
            for chunk in gl.static_range(HALF_M // _COPY_ROWS):
                token = first_row + chunk * _COPY_ROWS + offs_copy
                # A row already at capacity (only with check=False) stores nothing: tokens past it are dropped.
                mask = ((token < num_new) & (seq_len + token < capacity))[:, None] & (offs_d_copy < D)[None, :]
                src = (new_row + token).to(gl.int64)[:, None] * D + offs_d_copy[None, :]
                dst = (cache_row + seq_len + token).to(gl.int64)[:, None] * cache_row_stride + cache_col
                dst = dst + offs_d_copy[None, :]
                gl.store(k_cache_ptr + dst, gl.load(k_ptr + src, mask=mask), mask=mask)
                gl.store(v_cache_ptr + dst, gl.load(v_ptr + src, mask=mask), mask=mask)

        # -- attend: cached prefix, then the new tokens (causal on the diagonal) --
        token = first_row + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
        offs_n = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([HALF_M, D], gl.float32, o_layout)
        zero_scores = gl.zeros([HALF_M, TILE_N], gl.float32, s_layout)
        q = q_smem.index(HALF)
        last_token = first_row + HALF_M - 1
        tail_cache_tile = gl.where(seq_len % TILE_N != 0, num_cache_tiles - 1, -1)
        mbarrier.wait(q_ready, 0)
        for i in range(num_tiles):
            stage = i % STAGES
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            new0 = (i - num_cache_tiles) * TILE_N  # first new token of the tile (negative: a cache tile)
            if i == tail_cache_tile:
                # The tile runs past seq_len into garbage (maybe NaN): p is 0 there, but 0 * NaN is not. One half
                # zeroes those V rows in shared memory and tells the other, which reads the same stage.
                if HALF == 0:
                    for chunk in gl.static_range(TILE_N // _COPY_ROWS):
                        rows = v_tiles.index(stage).slice(chunk * _COPY_ROWS, _COPY_ROWS)
                        key = i * TILE_N + chunk * _COPY_ROWS + offs_copy
                        rows.store(gl.where((key < seq_len)[:, None], rows.load(rows_copy), 0.0).to(dtype))
                    partition_barrier()
                    fence_async_shared()
                    mbarrier.arrive(tail_fixed, count=1)
                else:
                    mbarrier.wait(tail_fixed, 0)
            if new0 <= last_token:  # else every key of the tile is past this half's rows: only release it
                token_s = warpgroup_mma(q, k_tiles.index(stage).permute((1, 0)), zero_scores, use_acc=False,
                                        is_async=True)  # fmt: skip
                scores = warpgroup_mma_wait(0, deps=[token_s])
                if i == tail_cache_tile:
                    scores = gl.where((i * TILE_N + offs_n < seq_len)[None, :], scores, float("-inf"))
                elif i >= num_cache_tiles and new0 + TILE_N - 1 > first_row:  # a diagonal tile
                    scores = gl.where((new0 + offs_n)[None, :] <= token[:, None], scores, float("-inf"))
                p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i, qk_scale)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p_op = gl.convert_layout(p.to(dtype), p_operand)
                token_o = warpgroup_mma(p_op, v_tiles.index(stage), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[token_o])
            mbarrier.arrive(empty.index(stage), count=1)

        # -- epilogue --
        l_out = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = acc / gl.where(l_out > 0.0, l_out, 1.0)[:, None]
        out_token = first_row + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        out_offsets = out_base + out_token.to(gl.int64)[:, None] * out_token_stride + offs_d[None, :]
        gl.store(out_ptr + out_offsets, out.to(dtype), mask=(out_token < num_new)[:, None])

    @gluon.jit
    def _warp_specialized_prefill_kernel(
        q_ptr,  # [B, H_q, S_q, D], contiguous (a tensor first: CachedLauncher reads the device off it)
        k_ptr,  # [B, H_kv, S_q, D], contiguous: the append's source
        v_ptr,
        k_cache_ptr,  # [B, H_kv, S_max, D], a layout common.cache_tile_grid takes: the append's target
        v_cache_ptr,
        out_ptr,  # [B, H_q, S_q, D], unit stride along D; contiguous, or token-major (run's out)
        seq_lens_ptr,  # [B] int32
        row_tickets_ptr,  # [B] int32, zero between calls: the row's last program resets it
        q_desc,  # TMA descriptor over query [B * H_q * S_q, D], [64, D] boxes
        k_desc,  # over key [B * H_kv * S_q, D], [BLOCK_N, D] boxes
        v_desc,
        k_cache_desc,  # over k_cache seen as its CacheTileGrid's 2D view, [BLOCK_N, D] boxes
        v_cache_desc,
        cache_row_stride, rows_per_batch, rows_per_head, cols_per_head,  # the caches' CacheTileGrid (cols first)
        num_new,  # S_q
        capacity,  # S_max
        num_q_heads,
        num_kv_heads,
        rows_per_group,  # (batch, query head) rows per launch-order group, a multiple of the GQA group
        qk_scale,  # softmax scale * log2(e)
        out_batch_stride, out_head_stride, out_token_stride,  # out's strides, in elements
        BLOCK_M: gl.constexpr,
        NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        # -- launch order --
        # The Triton kernel's (triton/attention.py), written again because Gluon cannot call @triton.jit code:
        # longest first, within groups of rows whose K/V fit in L2 together. Axis 0 varies fastest in launch order;
        # the i-th program of a group takes its row i % rows_in_group and, counting from the last, its M block
        # i // rows_in_group, so every row's heaviest causal block starts before the lighter ones of any row in the
        # group (NOTES.md, entry 40).
        num_rows = gl.num_programs(0)
        num_m_blocks = gl.num_programs(1)
        launch_index = gl.program_id(1) * num_rows + gl.program_id(0)
        first_row_of_group = (launch_index // (rows_per_group * num_m_blocks)) * rows_per_group
        rows_in_group = gl.minimum(num_rows - first_row_of_group, rows_per_group)
        index_in_group = launch_index - first_row_of_group * num_m_blocks
        pid_bh = first_row_of_group + index_in_group % rows_in_group
        pid_m = num_m_blocks - 1 - index_in_group // rows_in_group

        # -- row metadata --
        batch = pid_bh // num_q_heads
        head = pid_bh % num_q_heads
        group = num_q_heads // num_kv_heads
        kv_head = head // group
        # With check=False seq_lens may be negative or past capacity; reads and writes stay inside the cache.
        seq_len_before = gl.load(seq_lens_ptr + batch)
        seq_len = gl.minimum(gl.maximum(seq_len_before, 0), capacity)
        m0 = pid_m * BLOCK_M
        TILE_N: gl.constexpr = k_desc.block_type.shape[0]
        num_cache_tiles = gl.cdiv(seq_len, TILE_N)
        num_tiles = num_cache_tiles + gl.cdiv(gl.minimum(m0 + BLOCK_M, num_new), TILE_N)
        kv_row = batch * num_kv_heads + kv_head

        HALF_M: gl.constexpr = BLOCK_M // 2
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF_M, q_desc.block_type.shape[1]], q_desc.layout)
        k_tiles = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_tiles = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        tail_fixed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.init(tail_fixed, count=1)
        for stage in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(stage), count=1)
            mbarrier.init(empty.index(stage), count=2)  # both consumer warpgroups hand it back

        args = (
            q_desc, k_desc, v_desc, k_cache_desc, v_cache_desc, q_smem, k_tiles, v_tiles, q_ready, ready, empty,
            tail_fixed, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seq_lens_ptr, row_tickets_ptr,
            batch, seq_len_before, seq_len, num_new, capacity, pid_bh * num_new + m0, kv_row * num_new,
            batch * rows_per_batch + kv_head * rows_per_head, kv_head * cols_per_head, cache_row_stride, m0,
            num_cache_tiles, num_tiles, num_m_blocks * num_q_heads, head % group == 0, qk_scale,
            batch.to(gl.int64) * out_batch_stride + head.to(gl.int64) * out_head_stride, out_token_stride,
        )  # fmt: skip
        gl.warp_specialize(
            [(_attend_half, (args, 0)), (_attend_half, (args, 1)), (_stream_tiles, (args, 0))],
            [4, 1],
            [_CONSUMER_REGISTERS, _PRODUCER_REGISTERS],
        )

    _launch_prefill = CachedLauncher(_warp_specialized_prefill_kernel)


TAKES_OUT = True  # run takes out=: see flashcore.kernels


def run(call: KernelCall, out: torch.Tensor | None = None) -> torch.Tensor:
    """Append-and-attend for a call that :func:`supports` accepts, in one launch; returns the output, written into
    ``out`` where one is given: ``[B, H_q, S_q, D]`` of the query's dtype and device, unit stride along D, any other
    strides. A token-major one (``torch.empty(B, S_q, H_q, D).transpose(1, 2)``) is what a
    model's o projection reads, with no copy between them."""
    query, key, value, k_cache, v_cache, seq_lens, _, _, scale, _ = call
    batch, num_q_heads, num_new, _ = query.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(3) != 1:
        raise ValueError(
            f"out must be [B, H_q, S_q, D] {tuple(query.shape)} of {query.dtype} on {query.device} with a unit stride "
            f"along D, got {tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}"
        )
    if batch == 0:
        return out
    row_tickets = scratch_buffer("row_tickets", batch, torch.int32, query.device)
    num_m_blocks = -(-num_new // CONFIG.block_m)
    group = num_q_heads // num_kv_heads
    rows_per_group = group * configs.rows_per_launch_group(
        batch * num_kv_heads, num_m_blocks, capacity, query.shape[-1], query.element_size(), query.device
    )
    k_cache_desc, grid = cached_tile_descriptor(k_cache, CONFIG.block_n)
    v_cache_desc = cached_tile_descriptor(v_cache, CONFIG.block_n)[0]  # the same grid: supports() checked the strides
    # The cached launch path: through the JIT, a 2k-token call was host-bound (NOTES.md, entry 30).
    _launch_prefill(
        (batch * num_q_heads, num_m_blocks, 1),
        (
            query, key, value, k_cache, v_cache, out, seq_lens, row_tickets,
            tile_descriptor(query, CONFIG.block_m // 2), tile_descriptor(key, CONFIG.block_n),
            tile_descriptor(value, CONFIG.block_n),
            k_cache_desc, v_cache_desc, grid.cols, grid.rows_per_batch, grid.rows_per_head, grid.cols_per_head,
            num_new, capacity, num_q_heads, num_kv_heads, rows_per_group, scale * configs.LOG2_E, *out.stride()[:3],
        ),
        dict(BLOCK_M=CONFIG.block_m, NUM_STAGES=CONFIG.num_stages),
        num_warps=4,
        num_stages=CONFIG.num_stages,
        maxnreg=CONFIG.max_registers,
    )  # fmt: skip
    return out
