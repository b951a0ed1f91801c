"""A few-row SwiGLU MLP in one launch (sm_90, Gluon): ``out = down(silu_and_mul(gate, up)) (+ residual)`` for up
to 16 rows, where ``gate`` and ``up`` are a fused gate/up projection's two halves.

``rows_gemm.py`` runs the MLP of a decode step of a few rows as two launches: gate/up with the SiLU-and-mul in its
epilogue, then the down projection. Between them every SM drains: the down projection's programs start their
weight stream only as SMs free up, and read the activations only once the whole gate/up grid has ended. Here one
grid does both, as two phases of each program:

1. Program ``p`` computes the activations of gate/up block ``p`` (``BLOCK_N`` outputs, all of K), as
   ``rows_gemm``'s ``swiglu`` call does, writes them, and counts its block as done for the down projection's K
   slice that reads it (``flags[slice]``, a release).
2. The same program then computes down-projection work item ``p`` (one ``BLOCK_N`` block of outputs over one K
   slice). Its first weight tiles are already in shared memory (copied while phase 1 ran); it waits only until the
   gate/up blocks of its own K slice are done (an acquire), then streams the rest, and the split-K ticket of
   ``rows_gemm`` adds the slices in K order.

The grid must be resident all at once, since a program of phase 2 waits on programs of phase 1: the host wrapper
launches it only where it has at most one program per SM (:func:`supports`). The outputs have the bits of the two
``rows_gemm`` launches it replaces (the same tiles, splits, sums and epilogues).
"""

from __future__ import annotations

import functools

import torch
import triton

from flashcore.kernels.gluon_sm90 import common
from flashcore.kernels.gluon_sm90 import rows_gemm as tma_rows_gemm
from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch
from flashcore.kernels.scratch import scratch_buffer

MAX_ROWS = tma_rows_gemm.MAX_ROWS
FIRST_SPLIT_COUNTER = 4  # flags: the o blocks done, their readers, the norm slices done, their readers; then slices
BLOCK_N = tma_rows_gemm.BLOCK_N
BLOCK_K = tma_rows_gemm.BLOCK_K

if common.HAS_GLUON:
    from flashcore.kernels.gluon_sm90.common import gl, gluon, mbarrier, tma_load, warpgroup_mma, warpgroup_mma_wait
    from flashcore.kernels.gluon_sm90.rows_gemm import _store_output

    # flags_ptr's counters, each zeroed by the last program that waits on it (``_wait_for_count``).
    O_DONE, O_READERS, NORM_DONE, NORM_READERS = (gl.constexpr(i) for i in range(4))
    SPLITS_DONE = gl.constexpr(FIRST_SPLIT_COUNTER)  # then per K slice of the down projection: done, then readers

    @gluon.jit
    def _fence_proxy_async_global():
        """Orders what this thread's acquire made visible in global memory before its later TMA copies, which read
        through the async proxy."""
        gl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _count_done(flags_ptr, index):
        """Every warp's stores before the count (the split-K ticket's pattern); release: they are visible to whoever
        acquires the count."""
        common.partition_barrier()
        gl.atomic_add(flags_ptr + index, 1, sem="release")

    @gluon.jit
    def _wait_for_count(flags_ptr, index, target, readers_index, readers, SLEEP_NS: gl.constexpr):
        """Spins until ``flags[index]`` reaches ``target`` (an acquire), sleeping ``SLEEP_NS`` between reads. The
        last of the ``readers`` programs that wait on it zeroes it and its reader count for the next launch: every
        count it adds up is in by then."""
        done = gl.atomic_add(flags_ptr + index, 0, sem="acquire")
        while done < target:
            if SLEEP_NS > 0:
                gl.inline_asm_elementwise(
                    f"nanosleep.u32 {SLEEP_NS}; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
                )
            done = gl.atomic_add(flags_ptr + index, 0, sem="acquire")
        if gl.atomic_add(flags_ptr + readers_index, 1, sem="relaxed") == readers - 1:
            gl.atomic_xchg(flags_ptr + index, 0)
            gl.atomic_xchg(flags_ptr + readers_index, 0)
        _fence_proxy_async_global()

    @gluon.jit
    def _copy_first_weight_tiles(desc, tiles, ready, row0, k0, num_tiles, stage_bytes, NUM_STAGES: gl.constexpr):
        """Starts the TMA copies of a ring's first ``NUM_STAGES`` weight tiles; each stage's barrier expects
        ``stage_bytes`` (the weight tile and the input's tile copied later)."""
        BLOCK_K: gl.constexpr = desc.block_type.shape[1]
        for stage in gl.static_range(NUM_STAGES):
            if stage < num_tiles:
                mbarrier.expect(ready.index(stage), stage_bytes)
                tma_load(desc, [row0, k0 + stage * BLOCK_K], ready.index(stage), tiles.index(stage))

    @gluon.jit
    def _stream(w_desc, x_desc, w_tiles, x_tiles, ready, row0, k0, num_tiles, acc,
                NUM_STAGES: gl.constexpr, PREFETCHED: gl.constexpr):  # fmt: skip
        """``acc`` plus weight rows ``[row0, row0 + BLOCK_N)`` times the input's rows over ``num_tiles`` K tiles from
        ``k0``, through a ring of ``NUM_STAGES`` stages whose first ``PREFETCHED`` weight tiles are on their way
        (:func:`_copy_first_weight_tiles`); the input's tiles are copied from here on."""
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        stage_bytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
        for stage in gl.static_range(PREFETCHED, NUM_STAGES):
            if stage < num_tiles:
                mbarrier.expect(ready.index(stage), stage_bytes)
                tma_load(w_desc, [row0, k0 + stage * BLOCK_K], ready.index(stage), w_tiles.index(stage))
        for stage in gl.static_range(NUM_STAGES):
            if stage < num_tiles:
                tma_load(x_desc, [0, k0 + stage * BLOCK_K], ready.index(stage), x_tiles.index(stage))
        for i in range(num_tiles):
            slot = i % NUM_STAGES
            mbarrier.wait(ready.index(slot), (i // NUM_STAGES) & 1)
            acc = warpgroup_mma(w_tiles.index(slot), x_tiles.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            refill = i + NUM_STAGES
            if refill < num_tiles:
                mbarrier.expect(ready.index(slot), stage_bytes)
                tma_load(w_desc, [row0, k0 + refill * BLOCK_K], ready.index(slot), w_tiles.index(slot))
                tma_load(x_desc, [0, k0 + refill * BLOCK_K], ready.index(slot), x_tiles.index(slot))
        return acc

    @gluon.jit
    def _tma_rows_mlp_kernel(
        out_ptr,  # [M, H], contiguous (a tensor first: CachedLauncher reads the device off it)
        gate_up_desc,  # over the fused gate/up weight [2 I, H], [BLOCK_N, BLOCK_K] boxes
        x_desc,  # over the MLP's input [M, H], [MAX_ROWS, BLOCK_K] boxes (WITH_O: over normed)
        down_desc,  # over the down weight [H, I], [BLOCK_N, BLOCK_K] boxes
        activated_desc,  # over activated [M, I], [MAX_ROWS, BLOCK_K] boxes
        activated_ptr,  # [M, I], contiguous: phase 1 writes it, phase 2 reads it
        gate_up_bias_ptr,  # [2 I]; read only when HAS_GATE_UP_BIAS
        down_bias_ptr,  # [H]; read only when HAS_DOWN_BIAS
        residual_ptr,  # [M, H], unit stride along H; read only when HAS_RESIDUAL (WITH_O: total)
        partial_ptr,  # [DOWN_SPLIT, MAX_ROWS, H] fp32; used only when DOWN_SPLIT > 1
        tickets_ptr,  # [H / BLOCK_N] int32, zero between launches; used only when DOWN_SPLIT > 1
        flags_ptr,  # [SPLITS_DONE + 2 * DOWN_SPLIT] int32, zero between launches
        o_desc,  # WITH_O: over the o projection's weight [H, K_o], [BLOCK_N, BLOCK_K] boxes
        attn_desc,  # WITH_O: over the attention's output [M, K_o], [MAX_ROWS, BLOCK_K] boxes
        o_bias_ptr,  # [H]; read only when HAS_O_BIAS
        layer_input_ptr,  # WITH_O: [M, H], unit stride along H, the residual the o projection is added to
        norm_weight_ptr,  # WITH_O: [H]
        total_ptr,  # WITH_O: [M, H], contiguous: layer input + o projection, the MLP's residual
        normed_ptr,  # WITH_O: [M, H], contiguous: rms_norm(total), the MLP's input
        squares_ptr,  # WITH_O: [H / BLOCK_N, MAX_ROWS] fp32: each o block's sums of squares of total
        m,
        intermediate,  # I
        hidden,  # H
        stride_residual_m,
        stride_layer_input_m,
        eps,
        gate_up_tiles,  # H / BLOCK_K
        down_tiles_per_split,  # I / BLOCK_K / DOWN_SPLIT
        o_tiles,  # K_o / BLOCK_K
        DOWN_SPLIT: gl.constexpr,
        GATE_UP_STAGES: gl.constexpr,
        DOWN_STAGES: gl.constexpr,
        DOWN_PREFETCH: gl.constexpr,  # how many of the down projection's first tiles are copied before its wait
        WITH_O: gl.constexpr,  # phase 0: the o projection, the residual add and the RMSNorm before the MLP
        O_STAGES: gl.constexpr,
        O_BLOCKS_PAD: gl.constexpr,  # H / BLOCK_N, to a power of two
        SLEEP_NS: gl.constexpr,  # between two reads of a count a program waits on
        HAS_O_BIAS: gl.constexpr,
        HAS_GATE_UP_BIAS: gl.constexpr,
        HAS_DOWN_BIAS: gl.constexpr,
        HAS_RESIDUAL: gl.constexpr,
        USE_PDL: gl.constexpr,
    ):
        BLOCK_N: gl.constexpr = gate_up_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = gate_up_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        RING_STAGES: gl.constexpr = DOWN_STAGES if DOWN_STAGES > O_STAGES else O_STAGES
        pid = gl.program_id(0)
        gate_up_blocks = intermediate // BLOCK_N
        down_blocks = hidden // BLOCK_N
        blocks_per_split = gate_up_blocks // DOWN_SPLIT
        does_o = pid < down_blocks  # WITH_O only: the o projection has the down projection's H outputs
        does_gate_up = pid < gate_up_blocks
        does_down = pid < down_blocks * DOWN_SPLIT
        down_block = pid % down_blocks
        split = pid // down_blocks
        down_row0 = down_block * BLOCK_N
        down_k0 = split * down_tiles_per_split * BLOCK_K

        g_tiles = gl.allocate_shared_memory(gate_up_desc.dtype, [GATE_UP_STAGES, BLOCK_N, BLOCK_K], gate_up_desc.layout)
        u_tiles = gl.allocate_shared_memory(gate_up_desc.dtype, [GATE_UP_STAGES, BLOCK_N, BLOCK_K], gate_up_desc.layout)
        x_tiles = gl.allocate_shared_memory(x_desc.dtype, [GATE_UP_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        # One ring for the o projection (phase 0), then the down projection (phase 2): phase 0 has ended in a
        # program before its down tiles are copied.
        w_tiles = gl.allocate_shared_memory(down_desc.dtype, [RING_STAGES, BLOCK_N, BLOCK_K], down_desc.layout)
        a_tiles = gl.allocate_shared_memory(
            activated_desc.dtype, [RING_STAGES, BLOCK_M, BLOCK_K], activated_desc.layout
        )
        gate_up_ready = gl.allocate_shared_memory(gl.int64, [GATE_UP_STAGES, 1], mbarrier.MBarrierLayout())
        down_ready = gl.allocate_shared_memory(gl.int64, [DOWN_STAGES, 1], mbarrier.MBarrierLayout())
        o_ready = gl.allocate_shared_memory(gl.int64, [O_STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(GATE_UP_STAGES):
            mbarrier.init(gate_up_ready.index(stage), count=1)
        for stage in gl.static_range(DOWN_STAGES):
            mbarrier.init(down_ready.index(stage), count=1)
        for stage in gl.static_range(O_STAGES):
            mbarrier.init(o_ready.index(stage), count=1)
        gate_up_bytes: gl.constexpr = 2 * gate_up_desc.block_type.nbytes + x_desc.block_type.nbytes
        down_bytes: gl.constexpr = down_desc.block_type.nbytes + activated_desc.block_type.nbytes
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        mask_m = offs_m < m

        # Weight tiles first, while the kernel before may still run.
        if WITH_O:
            if does_o:
                o_bytes: gl.constexpr = o_desc.block_type.nbytes + attn_desc.block_type.nbytes
                _copy_first_weight_tiles(o_desc, w_tiles, o_ready, pid * BLOCK_N, 0, o_tiles, o_bytes, O_STAGES)
        row0 = pid * BLOCK_N
        if does_gate_up:
            for stage in gl.static_range(GATE_UP_STAGES):
                if stage < gate_up_tiles:
                    mbarrier.expect(gate_up_ready.index(stage), gate_up_bytes)
                    tma_load(gate_up_desc, [row0, stage * BLOCK_K], gate_up_ready.index(stage), g_tiles.index(stage))
                    tma_load(gate_up_desc, [intermediate + row0, stage * BLOCK_K], gate_up_ready.index(stage),
                             u_tiles.index(stage))  # fmt: skip
        if USE_PDL:
            common.wait_for_previous_grid()
            common.launch_dependents()

        # Phase 0: o block pid, plus the layer's input (add_rms_norm's sum, to its bits); once every block's sums
        # of squares are in, its slice of the norm, the MLP's input.
        if WITH_O:
            if does_o:
                acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
                acc = _stream(o_desc, attn_desc, w_tiles, a_tiles, o_ready, row0, 0, o_tiles, acc, O_STAGES, O_STAGES)
                offs_n = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
                mask_n = offs_n < hidden
                mask = mask_n[:, None] & mask_m[None, :]
                tile = offs_m[None, :] * hidden + offs_n[:, None]
                if HAS_O_BIAS:
                    acc += gl.load(o_bias_ptr + offs_n, mask=mask_n, other=0.0).to(gl.float32)[:, None]
                projected = acc.to(total_ptr.dtype.element_ty)
                layer_input = gl.load(
                    layer_input_ptr + offs_m[None, :] * stride_layer_input_m + offs_n[:, None], mask=mask, other=0.0
                )
                total = (layer_input.to(gl.float32) + projected.to(gl.float32)).to(total_ptr.dtype.element_ty)
                gl.store(total_ptr + tile, total, mask=mask)
                total_f32 = total.to(gl.float32)
                gl.store(squares_ptr + pid * BLOCK_M + offs_m, gl.sum(total_f32 * total_f32, axis=0))
                _count_done(flags_ptr, O_DONE)
                _wait_for_count(flags_ptr, O_DONE, down_blocks, O_READERS, down_blocks, SLEEP_NS)
                squares_layout: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])
                offs_block = gl.arange(0, O_BLOCKS_PAD, layout=gl.SliceLayout(1, squares_layout))
                offs_row = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, squares_layout))
                squares = gl.load(
                    squares_ptr + offs_block[:, None] * BLOCK_M + offs_row[None, :],
                    mask=(offs_block < down_blocks)[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                mean_square = gl.convert_layout(gl.sum(squares, axis=0), gl.SliceLayout(0, mma)) / hidden
                inv_rms = gl.rsqrt(mean_square + eps)
                normalized = (total_f32 * inv_rms[None, :]).to(total_ptr.dtype.element_ty)
                norm_weight = gl.load(norm_weight_ptr + offs_n, mask=mask_n, other=0.0).to(gl.float32)
                normed = (norm_weight[:, None] * normalized.to(gl.float32)).to(total_ptr.dtype.element_ty)
                gl.store(normed_ptr + tile, normed, mask=mask)
                _count_done(flags_ptr, NORM_DONE)

        # Phase 1: gate/up block pid, with the SiLU-and-mul, as rows_gemm's swiglu call.
        if does_gate_up:
            if WITH_O:
                _wait_for_count(flags_ptr, NORM_DONE, down_blocks, NORM_READERS, gate_up_blocks, SLEEP_NS)
            for stage in gl.static_range(GATE_UP_STAGES):
                if stage < gate_up_tiles:
                    tma_load(x_desc, [0, stage * BLOCK_K], gate_up_ready.index(stage), x_tiles.index(stage))
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            acc_up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            for i in range(gate_up_tiles):
                slot = i % GATE_UP_STAGES
                mbarrier.wait(gate_up_ready.index(slot), (i // GATE_UP_STAGES) & 1)
                x_tile = x_tiles.index(slot).permute((1, 0))
                acc = warpgroup_mma(g_tiles.index(slot), x_tile, acc, is_async=True)
                acc_up = warpgroup_mma(u_tiles.index(slot), x_tile, acc_up, is_async=True)
                acc, acc_up = warpgroup_mma_wait(0, deps=[acc, acc_up])
                refill = i + GATE_UP_STAGES
                if refill < gate_up_tiles:
                    mbarrier.expect(gate_up_ready.index(slot), gate_up_bytes)
                    tma_load(gate_up_desc, [row0, refill * BLOCK_K], gate_up_ready.index(slot), g_tiles.index(slot))
                    tma_load(gate_up_desc, [intermediate + row0, refill * BLOCK_K], gate_up_ready.index(slot),
                             u_tiles.index(slot))  # fmt: skip
                    tma_load(x_desc, [0, refill * BLOCK_K], gate_up_ready.index(slot), x_tiles.index(slot))
            if does_down:
                _copy_first_weight_tiles(down_desc, w_tiles, down_ready, down_row0, down_k0, down_tiles_per_split,
                                         down_bytes, DOWN_PREFETCH)  # fmt: skip
            offs_n = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
            mask_n = offs_n < intermediate
            mask = mask_n[:, None] & mask_m[None, :]
            _store_output(acc, acc_up, gate_up_bias_ptr, activated_ptr, activated_ptr,
                          offs_m[None, :] * intermediate + offs_n[:, None], offs_n, offs_m, mask_n, mask,
                          intermediate, 0, True, HAS_GATE_UP_BIAS, False)  # fmt: skip
            _count_done(flags_ptr, SPLITS_DONE + pid // blocks_per_split)
        else:
            if does_down:
                _copy_first_weight_tiles(down_desc, w_tiles, down_ready, down_row0, down_k0, down_tiles_per_split,
                                         down_bytes, DOWN_PREFETCH)  # fmt: skip

        # Phase 2: down block down_block over K slice split, once that slice's gate/up blocks are written.
        if does_down:
            _wait_for_count(flags_ptr, SPLITS_DONE + split, blocks_per_split, SPLITS_DONE + DOWN_SPLIT + split,
                            down_blocks, SLEEP_NS)  # fmt: skip
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            acc = _stream(down_desc, activated_desc, w_tiles, a_tiles, down_ready, down_row0, down_k0,
                          down_tiles_per_split, acc, DOWN_STAGES, DOWN_PREFETCH)  # fmt: skip
            offs_n = down_row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
            mask_n = offs_n < hidden
            mask = mask_n[:, None] & mask_m[None, :]
            tile = offs_m[None, :] * hidden + offs_n[:, None]
            if DOWN_SPLIT > 1:
                # rows_gemm's split-K ticket: the last taker adds the slices in K order.
                gl.store(partial_ptr + split * BLOCK_M * hidden + tile, acc, mask=mask)
                common.partition_barrier()
                if gl.atomic_add(tickets_ptr + down_block, 1, sem="acq_rel") == DOWN_SPLIT - 1:
                    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
                    for s in gl.static_range(DOWN_SPLIT):
                        acc += gl.load(partial_ptr + s * BLOCK_M * hidden + tile, mask=mask, other=0.0,
                                       cache_modifier=".cg")  # fmt: skip
                    _store_output(acc, acc, down_bias_ptr, residual_ptr, out_ptr, tile, offs_n, offs_m, mask_n, mask,
                                  hidden, stride_residual_m, False, HAS_DOWN_BIAS, HAS_RESIDUAL)  # fmt: skip
                    gl.atomic_xchg(tickets_ptr + down_block, 0)
            else:
                _store_output(acc, acc, down_bias_ptr, residual_ptr, out_ptr, tile, offs_n, offs_m, mask_n, mask,
                              hidden, stride_residual_m, False, HAS_DOWN_BIAS, HAS_RESIDUAL)  # fmt: skip
        for stage in gl.static_range(GATE_UP_STAGES):
            mbarrier.invalidate(gate_up_ready.index(stage))
        for stage in gl.static_range(DOWN_STAGES):
            mbarrier.invalidate(down_ready.index(stage))
        for stage in gl.static_range(O_STAGES):
            mbarrier.invalidate(o_ready.index(stage))

    _launch_tma_rows_mlp = CachedLauncher(_tma_rows_mlp_kernel)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(hidden: int, intermediate: int) -> int:
    """The larger phase: the gate/up blocks, or the down projection's blocks times its K slices (phase 0's o blocks
    are the down projection's blocks)."""
    return max(intermediate // BLOCK_N, hidden // BLOCK_N * mlp_config(hidden, intermediate)["down_split"])


def supports(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> bool:
    """Whether one launch takes the MLP: ``rows_gemm``'s TMA kernel takes both projections (``swiglu`` for gate/up),
    the down weight is ``[H, I]`` for a gate/up weight of ``[2 I, H]``, both in whole ``BLOCK_N`` blocks, and the
    grid (the larger of the gate/up blocks and the down projection's blocks times its K slices) is at most one
    program per SM, so all of it is resident at once."""
    hidden, intermediate = x.shape[-1], gate_up_weight.shape[0] // 2
    if down_weight.shape != (hidden, intermediate) or hidden % BLOCK_N or intermediate % BLOCK_N:
        return False
    x_rows = x.reshape(-1, hidden)
    if not (tma_rows_gemm.supports(x_rows, gate_up_weight, swiglu=True) and down_weight.dtype == x.dtype):
        return False
    if down_weight.stride(1) != 1 or (down_weight.stride(0) * down_weight.element_size()) % 16:
        return False
    if (intermediate // BLOCK_N) % mlp_config(hidden, intermediate)["down_split"]:
        return False
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _grid(hidden, intermediate) <= _multiprocessors(device)


def supports_post_attention(
    attn: torch.Tensor, o_weight: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor
) -> bool:
    """Whether one launch takes the o projection, the residual add, the RMSNorm and the MLP: ``rows_gemm``'s TMA
    kernel for the o projection of ``attn`` ``[M, K_o]``, square (``[H, H]``, K_o = H: the attention's output then has
    the MLP input's shape, for :func:`supports` to check), and at most ``MAX_O_BLOCKS`` blocks of it."""
    return (
        attn.dim() == 2
        and o_weight.shape == (attn.shape[1], attn.shape[1])
        and attn.shape[1] // BLOCK_N <= MAX_O_BLOCKS
        and tma_rows_gemm.supports(attn, o_weight)
        and supports(attn, gate_up_weight, down_weight)
    )


@functools.cache
def mlp_config(hidden: int, intermediate: int) -> dict:
    """The phases' rings and the down projection's K slices: ``rows_gemm``'s configurations for the launches this
    one replaces (``tma_rows_gemm_config``); of the down projection's ring, 2 tiles copied before its wait (entry
    80: −4.5 µs a B=16 step against all 4, −7.7 against none)."""
    gate_up = tma_rows_gemm.tma_rows_gemm_config(hidden, True)
    down = tma_rows_gemm.tma_rows_gemm_config(intermediate, False)
    o = tma_rows_gemm.tma_rows_gemm_config(hidden, False)
    return dict(
        gate_up_stages=gate_up["num_stages"], down_split=down["split_k"], down_stages=down["num_stages"],
        down_prefetch=min(2, down["num_stages"]), o_stages=o["num_stages"], sleep_ns=0,
    )  # fmt: skip


MAX_O_BLOCKS = 64  # phase 0 sums every o block's squares in one load: H up to 4096


def tma_rows_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    **config,
) -> torch.Tensor:
    """``x`` ``[M, H]`` and the weights as :func:`supports` takes them, biases or None, ``residual`` ``[M, H]`` with
    unit stride along H or None; returns ``out`` (``[M, H]`` contiguous, a new one if None):
    ``down(silu_and_mul(gate, up)) (+ residual)``, with the bits of ``rows_gemm``'s two launches. ``config``
    overrides :func:`mlp_config` (probes)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, gate_up_weight, gate_up_bias, down_weight, down_bias, residual, out, config)
    return out


def tma_rows_post_attention(
    attn: torch.Tensor,
    layer_input: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    *,
    out: torch.Tensor | None = None,
    **config,
) -> torch.Tensor:
    """A decoder layer after its attention: ``total = layer_input + o(attn)`` (``add_rms_norm``'s sum, to its
    bits), then ``total + mlp(rms_norm(total))``, returned in ``out`` (``[M, H]`` contiguous, a new one if None).
    ``attn`` ``[M, K_o]`` and the weights as :func:`supports_post_attention` takes them; ``layer_input`` ``[M, H]``
    with unit stride along H. The norm sums each row's squares in another order than ``rms_norm``'s, so a value of
    its output may round the other way."""
    m, hidden = attn.shape[0], o_weight.shape[0]
    if out is None:
        out = torch.empty(m, hidden, dtype=attn.dtype, device=attn.device)
    total = scratch_buffer(f"rows_mlp_total_{attn.dtype}", m * hidden, attn.dtype, attn.device)[: m * hidden]
    normed = scratch_buffer(f"rows_mlp_normed_{attn.dtype}", m * hidden, attn.dtype, attn.device)[: m * hidden]
    prologue = (attn, layer_input, o_weight, o_bias, norm_weight, float(eps), total.view(m, hidden))
    _launch(normed.view(m, hidden), prologue, gate_up_weight, gate_up_bias, down_weight, down_bias,
            total.view(m, hidden), out, config)  # fmt: skip
    return out


def _launch(x, prologue, gate_up_weight, gate_up_bias, down_weight, down_bias, residual, out, overrides) -> None:
    """One launch of the kernel: the MLP of ``x``, or with ``prologue`` (``attn, layer_input, o_weight, o_bias,
    norm_weight, eps, total``) phase 0 first, which writes ``total`` and ``x``."""
    (m, hidden), intermediate = x.shape, gate_up_weight.shape[0] // 2
    config = mlp_config(hidden, intermediate)
    if set(overrides) - set(config):
        raise TypeError(f"unknown options {sorted(set(overrides) - set(config))}; mlp_config names {sorted(config)}")
    config = {**config, **overrides}
    split = config["down_split"]
    down_tiles_per_split = intermediate // BLOCK_K // split
    activated = scratch_buffer(f"rows_mlp_activated_{x.dtype}", m * intermediate, x.dtype, x.device)
    activated = activated[: m * intermediate].view(m, intermediate)
    flags = scratch_buffer("rows_mlp_flags", FIRST_SPLIT_COUNTER + 2 * split, torch.int32, x.device)
    partial, tickets = out, out
    if split > 1:
        partial = scratch_buffer("rows_gemm_partials", split * MAX_ROWS * hidden, torch.float32, x.device)
        tickets = scratch_buffer("rows_gemm_tickets", hidden // BLOCK_N, torch.int32, x.device)
    layout = tma_rows_gemm._shared_layout(x.dtype, MAX_ROWS)
    x_desc = common.TensorDescriptor.from_tensor(x, [MAX_ROWS, BLOCK_K], layout)
    activated_desc = common.TensorDescriptor.from_tensor(activated, [MAX_ROWS, BLOCK_K], layout)
    gate_up_stages = min(config["gate_up_stages"], hidden // BLOCK_K)
    down_stages = min(config["down_stages"], down_tiles_per_split)
    down_prefetch = min(config["down_prefetch"], down_stages)
    if prologue is None:
        o_desc, attn_desc, o_bias, layer_input, norm_weight, eps, total = (activated_desc, x_desc, None, out, out,
                                                                           0.0, out)  # fmt: skip
        squares, o_tiles, o_stages = out, 0, 1
    else:
        attn, layer_input, o_weight, o_bias, norm_weight, eps, total = prologue
        o_desc = tma_rows_gemm._weight_descriptor(o_weight)
        attn_desc = common.TensorDescriptor.from_tensor(attn, [MAX_ROWS, BLOCK_K], layout)
        squares = scratch_buffer("rows_mlp_squares", MAX_O_BLOCKS * MAX_ROWS, torch.float32, x.device)
        o_tiles = attn.shape[1] // BLOCK_K
        o_stages = min(config["o_stages"], o_tiles)
    use_pdl = uses_programmatic_launch(x.device)
    _launch_tma_rows_mlp(
        (_grid(hidden, intermediate), 1, 1),
        (
            out, tma_rows_gemm._weight_descriptor(gate_up_weight), x_desc,
            tma_rows_gemm._weight_descriptor(down_weight), activated_desc, activated,
            gate_up_bias if gate_up_bias is not None else out, down_bias if down_bias is not None else out,
            residual if residual is not None else out, partial, tickets, flags,
            o_desc, attn_desc, o_bias if o_bias is not None else out, layer_input, norm_weight, total, x, squares,
            m, intermediate, hidden, residual.stride(0) if residual is not None else 0, layer_input.stride(0), eps,
            hidden // BLOCK_K, down_tiles_per_split, o_tiles,
        ),
        dict(
            DOWN_SPLIT=split, GATE_UP_STAGES=gate_up_stages, DOWN_STAGES=down_stages, DOWN_PREFETCH=down_prefetch,
            WITH_O=prologue is not None, O_STAGES=o_stages, SLEEP_NS=config["sleep_ns"],
            O_BLOCKS_PAD=triton.next_power_of_2(hidden // BLOCK_N),
            HAS_O_BIAS=o_bias is not None, HAS_GATE_UP_BIAS=gate_up_bias is not None,
            HAS_DOWN_BIAS=down_bias is not None, HAS_RESIDUAL=residual is not None, USE_PDL=use_pdl,
        ),
        num_warps=4,
        num_stages=1,
        launch_pdl=use_pdl,
    )  # fmt: skip
