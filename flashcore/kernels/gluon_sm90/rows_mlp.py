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
   slice). Its first weight tiles are copied at the end of phase 1, before its block is counted; it waits only
   until the gate/up blocks of its own K slice are done (an acquire), then streams the rest, and the split-K ticket
   of ``rows_gemm`` adds the slices in K order.

The grid must be resident all at once, since a program of phase 2 waits on programs of phase 1: the host wrapper
launches it only where it has at most one program per SM (:func:`supports`). The outputs have the bits of the two
``rows_gemm`` launches it replaces (the same tiles, splits, sums and epilogues). On the Llama-3.2-1B shape it took
14 µs off a B=16 replayed step on the H100 (benchmarks/NOTES.md, entry 80). The o projection and the add-and-norm
as a phase 0 of the same grid were 43 µs slower (same entry).
"""

from __future__ import annotations

import functools

import torch

from flashcore.kernels.configs import num_sms
from flashcore.kernels.gluon_sm90 import common
from flashcore.kernels.gluon_sm90 import rows_gemm as tma_rows_gemm
from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch
from flashcore.kernels.scratch import scratch_buffer

MAX_ROWS = tma_rows_gemm.MAX_ROWS
BLOCK_N = tma_rows_gemm.BLOCK_N
BLOCK_K = tma_rows_gemm.BLOCK_K

if common.HAS_GLUON:
    from flashcore.kernels.gluon_sm90.common import gl, gluon, mbarrier
    from flashcore.kernels.gluon_sm90.rows_gemm import (
        copy_weight_tiles,
        load_residual,
        store_output,
        stream_weight_tiles,
    )

    @gluon.jit
    def _fence_proxy_async_global():
        """Orders what this thread's acquire made visible in global memory before its later TMA copies, which read
        through the async proxy."""
        gl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _tma_rows_mlp_kernel(
        out_ptr,  # [M, H], contiguous (a tensor first: CachedLauncher reads the device off it)
        gate_up_desc,  # over the fused gate/up weight [2 I, H], [BLOCK_N, BLOCK_K] boxes
        x_desc,  # over x [M, H], [MAX_ROWS, BLOCK_K] boxes
        down_desc,  # over the down weight [H, I], [BLOCK_N, BLOCK_K] boxes
        activated_desc,  # over activated [M, I], [MAX_ROWS, BLOCK_K] boxes
        activated_ptr,  # [M, I], contiguous: phase 1 writes it, phase 2 reads it
        gate_up_bias_ptr,  # [2 I]; read only when HAS_GATE_UP_BIAS
        down_bias_ptr,  # [H]; read only when HAS_DOWN_BIAS
        residual_ptr,  # [M, H], unit stride along H; read only when HAS_RESIDUAL
        partial_ptr,  # [DOWN_SPLIT, MAX_ROWS, H] fp32; used only when DOWN_SPLIT > 1
        tickets_ptr,  # [H / BLOCK_N] int32, zero between launches; used only when DOWN_SPLIT > 1
        flags_ptr,  # [2 * DOWN_SPLIT] int32, zero between launches: gate/up blocks done, then readers, per K slice
        m,
        intermediate,  # I
        hidden,  # H
        stride_residual_m,
        gate_up_tiles,  # H / BLOCK_K
        down_tiles_per_split,  # I / BLOCK_K / DOWN_SPLIT
        DOWN_SPLIT: gl.constexpr,
        GATE_UP_STAGES: gl.constexpr,
        DOWN_STAGES: gl.constexpr,
        DOWN_PREFETCH: gl.constexpr,  # how many of the down projection's first tiles are copied before its wait
        HAS_GATE_UP_BIAS: gl.constexpr,
        HAS_DOWN_BIAS: gl.constexpr,
        HAS_RESIDUAL: gl.constexpr,
        USE_PDL: gl.constexpr,
    ):
        BLOCK_N: gl.constexpr = gate_up_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = gate_up_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        pid = gl.program_id(0)
        gate_up_blocks = intermediate // BLOCK_N
        down_blocks = hidden // BLOCK_N
        blocks_per_split = gate_up_blocks // DOWN_SPLIT
        does_gate_up = pid < gate_up_blocks
        does_down = pid < down_blocks * DOWN_SPLIT
        down_block = pid % down_blocks
        split = pid // down_blocks
        down_row0 = down_block * BLOCK_N
        down_k0 = split * down_tiles_per_split * BLOCK_K

        g_tiles = gl.allocate_shared_memory(gate_up_desc.dtype, [GATE_UP_STAGES, BLOCK_N, BLOCK_K], gate_up_desc.layout)
        u_tiles = gl.allocate_shared_memory(gate_up_desc.dtype, [GATE_UP_STAGES, BLOCK_N, BLOCK_K], gate_up_desc.layout)
        x_tiles = gl.allocate_shared_memory(x_desc.dtype, [GATE_UP_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        d_tiles = gl.allocate_shared_memory(down_desc.dtype, [DOWN_STAGES, BLOCK_N, BLOCK_K], down_desc.layout)
        a_tiles = gl.allocate_shared_memory(
            activated_desc.dtype, [DOWN_STAGES, BLOCK_M, BLOCK_K], activated_desc.layout
        )
        gate_up_ready = gl.allocate_shared_memory(gl.int64, [GATE_UP_STAGES, 1], mbarrier.MBarrierLayout())
        down_ready = gl.allocate_shared_memory(gl.int64, [DOWN_STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(GATE_UP_STAGES):
            mbarrier.init(gate_up_ready.index(stage), count=1)
        for stage in gl.static_range(DOWN_STAGES):
            mbarrier.init(down_ready.index(stage), count=1)
        gate_up_bytes: gl.constexpr = 2 * gate_up_desc.block_type.nbytes + x_desc.block_type.nbytes
        down_bytes: gl.constexpr = down_desc.block_type.nbytes + activated_desc.block_type.nbytes
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        zeros = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)

        # Weight tiles first, while the kernel before may still run.
        row0 = pid * BLOCK_N
        if does_gate_up:
            copy_weight_tiles(gate_up_desc, g_tiles, u_tiles, gate_up_ready, row0, intermediate + row0, 0,
                              gate_up_tiles, gate_up_bytes, 0, GATE_UP_STAGES, True)  # fmt: skip
        if USE_PDL:
            common.wait_for_previous_grid()
            common.launch_dependents()
        down_offs_n = down_row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        residual = load_residual(residual_ptr, down_offs_n, offs_m, m, hidden, stride_residual_m, zeros, HAS_RESIDUAL)

        # Phase 1: gate/up block pid, with the SiLU-and-mul, as rows_gemm's swiglu call; then phase 2's first
        # weight tiles, before this block is counted.
        if does_gate_up:
            acc, acc_up = stream_weight_tiles(gate_up_desc, x_desc, g_tiles, u_tiles, x_tiles, gate_up_ready, row0,
                                              intermediate + row0, 0, gate_up_tiles, zeros, GATE_UP_STAGES,
                                              GATE_UP_STAGES, True)  # fmt: skip
            if does_down:
                copy_weight_tiles(down_desc, d_tiles, d_tiles, down_ready, down_row0, down_row0, down_k0,
                                  down_tiles_per_split, down_bytes, 0, DOWN_PREFETCH, False)  # fmt: skip
            offs_n = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
            store_output(acc, acc_up, gate_up_bias_ptr, activated_ptr, activated_ptr, activated_ptr, flags_ptr, pid, 0,
                         offs_n, offs_m, m, intermediate, 0, 1, True, HAS_GATE_UP_BIAS, False, acc, False)  # fmt: skip
            # Every warp's stores before the count (the split-K ticket's pattern); release: they are visible to
            # whoever acquires the count.
            common.partition_barrier()
            gl.atomic_add(flags_ptr + pid // blocks_per_split, 1, sem="release")
        else:
            if does_down:
                copy_weight_tiles(down_desc, d_tiles, d_tiles, down_ready, down_row0, down_row0, down_k0,
                                  down_tiles_per_split, down_bytes, 0, DOWN_PREFETCH, False)  # fmt: skip
        for stage in gl.static_range(GATE_UP_STAGES):
            mbarrier.invalidate(gate_up_ready.index(stage))

        # Phase 2: down block down_block over K slice split, once that slice's gate/up blocks are written.
        if does_down:
            done = gl.atomic_add(flags_ptr + split, 0, sem="acquire")
            while done < blocks_per_split:
                done = gl.atomic_add(flags_ptr + split, 0, sem="acquire")
            _fence_proxy_async_global()
            # The last of the slice's readers to get past the wait zeroes its two counts for the next launch.
            if gl.atomic_add(flags_ptr + DOWN_SPLIT + split, 1, sem="relaxed") == down_blocks - 1:
                gl.atomic_xchg(flags_ptr + split, 0)
                gl.atomic_xchg(flags_ptr + DOWN_SPLIT + split, 0)
            acc, _ = stream_weight_tiles(down_desc, activated_desc, d_tiles, d_tiles, a_tiles, down_ready, down_row0,
                                         down_row0, down_k0, down_tiles_per_split, zeros, DOWN_STAGES, DOWN_PREFETCH,
                                         False)  # fmt: skip
            store_output(acc, acc, down_bias_ptr, residual_ptr, out_ptr, partial_ptr, tickets_ptr, down_block, split,
                         down_offs_n, offs_m, m, hidden, stride_residual_m, DOWN_SPLIT, False, HAS_DOWN_BIAS,
                         HAS_RESIDUAL, residual, HAS_RESIDUAL)  # fmt: skip
        for stage in gl.static_range(DOWN_STAGES):
            mbarrier.invalidate(down_ready.index(stage))

    _launch_tma_rows_mlp = CachedLauncher(_tma_rows_mlp_kernel)


def supports(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> bool:
    """Whether one launch takes the MLP: ``rows_gemm``'s TMA kernel takes both projections (``swiglu`` for gate/up),
    the down weight is ``[H, I]`` for a gate/up weight of ``[2 I, H]``, H in whole ``BLOCK_N`` blocks and I in whole
    ``BLOCK_K`` tiles, and the
    grid (the larger of the gate/up blocks and the down projection's blocks times its K slices) is at most one
    program per SM, so all of it is resident at once."""
    hidden, intermediate = x.shape[-1], gate_up_weight.shape[0] // 2
    if down_weight.shape != (hidden, intermediate) or hidden % BLOCK_N or intermediate % BLOCK_K:
        return False  # the down projection's K (I) in whole tiles, as rows_gemm's TMA kernel takes K
    x_rows = x.reshape(-1, hidden)
    if not (tma_rows_gemm.supports(x_rows, gate_up_weight, swiglu=True) and down_weight.dtype == x.dtype):
        return False
    if down_weight.stride(1) != 1 or (down_weight.stride(0) * down_weight.element_size()) % 16:
        return False
    split = tma_rows_gemm.split_k_for(intermediate)  # mlp_config's down_split
    if (intermediate // BLOCK_N) % split:
        return False
    grid = max(intermediate // BLOCK_N, hidden // BLOCK_N * split)
    return grid <= num_sms(x.device)


@functools.cache
def mlp_config(hidden: int, intermediate: int) -> dict:
    """The two phases' rings and the down projection's K slices: ``rows_gemm``'s configurations for the two
    launches this one replaces (``tma_rows_gemm_config``), and how many of the down projection's first tiles are
    copied before its wait: 2 of its ring. On the Llama-3.2-1B shape in a B=16 replayed step (H100,
    ``probes/session_rows_mlp_b16.py`` at 04d6509, entry 80) 2 was the fastest of 0, 1, 2 and 4; a gate/up ring of 3
    was level with 2, and a down ring of 6, or of 5 with a gate/up ring of 3 (more bytes in flight before the wait),
    was slower."""
    gate_up = tma_rows_gemm.tma_rows_gemm_config(hidden, True)
    down = tma_rows_gemm.tma_rows_gemm_config(intermediate, False)
    return dict(
        gate_up_stages=gate_up["num_stages"], down_split=down["split_k"], down_stages=down["num_stages"],
        down_prefetch=min(2, down["num_stages"]),
    )  # fmt: skip


def tma_rows_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    gate_up_stages: int | None = None,
    down_stages: int | None = None,
    down_prefetch: int | None = None,
) -> torch.Tensor:
    """``x`` ``[M, H]`` and the weights as :func:`supports` takes them, biases or None, ``residual`` ``[M, H]`` with
    unit stride along H or None; returns ``out`` (``[M, H]`` contiguous, a new one if None):
    ``down(silu_and_mul(gate, up)) (+ residual)``, with the bits of ``rows_gemm``'s two launches. The rings and the
    down tiles copied before the wait override :func:`mlp_config`'s (probes)."""
    (m, hidden), intermediate = x.shape, gate_up_weight.shape[0] // 2
    if out is None:
        out = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    config = mlp_config(hidden, intermediate)
    split = config["down_split"]
    down_tiles_per_split = intermediate // BLOCK_K // split
    activated = scratch_buffer(f"rows_mlp_activated_{x.dtype}", m * intermediate, x.dtype, x.device)[: m * intermediate]
    activated = activated.view(m, intermediate)
    flags = scratch_buffer("rows_mlp_flags", 2 * split, torch.int32, x.device)
    partial, tickets = out, out
    if split > 1:
        partial = scratch_buffer("rows_gemm_partials", split * MAX_ROWS * hidden, torch.float32, x.device)
        tickets = scratch_buffer("rows_gemm_tickets", hidden // BLOCK_N, torch.int32, x.device)
    layout = tma_rows_gemm._shared_layout(x.dtype, MAX_ROWS)
    x_desc = common.TensorDescriptor.from_tensor(x, [MAX_ROWS, BLOCK_K], layout)
    activated_desc = common.TensorDescriptor.from_tensor(activated, [MAX_ROWS, BLOCK_K], layout)
    use_pdl = uses_programmatic_launch(x.device)
    grid = max(intermediate // BLOCK_N, hidden // BLOCK_N * split)
    gate_up_stages = min(gate_up_stages or config["gate_up_stages"], hidden // BLOCK_K)
    down_stages = min(down_stages or config["down_stages"], down_tiles_per_split)
    down_prefetch = min(config["down_prefetch"] if down_prefetch is None else down_prefetch, down_stages)
    _launch_tma_rows_mlp(
        (grid, 1, 1),
        (
            out, tma_rows_gemm._weight_descriptor(gate_up_weight), x_desc,
            tma_rows_gemm._weight_descriptor(down_weight), activated_desc, activated,
            gate_up_bias if gate_up_bias is not None else out, down_bias if down_bias is not None else out,
            residual if residual is not None else out, partial, tickets,
            flags, m, intermediate, hidden, residual.stride(0) if residual is not None else 0, hidden // BLOCK_K,
            down_tiles_per_split,
        ),
        dict(
            DOWN_SPLIT=split, GATE_UP_STAGES=gate_up_stages, DOWN_STAGES=down_stages,
            DOWN_PREFETCH=down_prefetch,
            HAS_GATE_UP_BIAS=gate_up_bias is not None, HAS_DOWN_BIAS=down_bias is not None,
            HAS_RESIDUAL=residual is not None, USE_PDL=use_pdl,
        ),
        num_warps=4,
        num_stages=1,
        launch_pdl=use_pdl,
    )  # fmt: skip
    return out
