"""A few-row projection with the residual add and the RMSNorm after it, in one launch (sm_90, Gluon): ``total =
residual + x @ weight.T (+ bias)`` and ``normed = rms_norm(total)`` for up to 16 rows. In a decode step of a few
rows: the o projection, then the add after attention and the norm before the MLP, which otherwise run as the TMA
few-row GEMM (``rows_gemm.py``) and the add-and-norm kernel (``kernels/triton/layer_kernels.py``).

The norm needs whole rows, and each program owns ``BLOCK_N`` columns of them. So each program computes its block of
the projection as ``rows_gemm`` does, adds the residual (rounded as ``add_rms_norm`` rounds), writes its block of
``total`` and its rows' sums of squares over the block, and counts its block as done (a release). Once every block is
counted (an acquire; all programs are resident at once, at most one per SM: :func:`supports`), each program reads
the blocks' sums in one load and normalizes its own block, still in registers.

``total`` has the bits of ``rows_gemm`` then ``add_rms_norm``; the norm sums each row's squares in another order
than ``rms_norm``'s, so a value of ``normed`` may round to its neighbour.
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
BLOCK_N = tma_rows_gemm.BLOCK_N
BLOCK_K = tma_rows_gemm.BLOCK_K
MAX_BLOCKS = 64  # the blocks' sums of squares are read in one load: N up to 4096

if common.HAS_GLUON:
    from flashcore.kernels.gluon_sm90.common import gl, gluon, mbarrier, tma_load, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def _tma_rows_gemm_norm_kernel(
        total_ptr,  # [M, N], contiguous (a tensor first: CachedLauncher reads the device off it)
        normed_ptr,  # [M, N], contiguous
        w_desc,  # over weight [N, K], [BLOCK_N, BLOCK_K] boxes
        x_desc,  # over x [M, K], [MAX_ROWS, BLOCK_K] boxes
        bias_ptr,  # [N]; read only when HAS_BIAS
        residual_ptr,  # [M, N], unit stride along N
        norm_weight_ptr,  # [N]
        squares_ptr,  # [N / BLOCK_N, MAX_ROWS] fp32: each block's sums of squares of total
        flags_ptr,  # [2] int32, zero between launches: the blocks done, the programs past the wait
        m,
        n,
        stride_residual_m,
        eps,
        k_tiles,
        NUM_STAGES: gl.constexpr,
        BLOCKS_PAD: gl.constexpr,  # N / BLOCK_N, to a power of two
        HAS_BIAS: gl.constexpr,
        USE_PDL: gl.constexpr,
    ):
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        block = gl.program_id(0)
        blocks = gl.num_programs(0)
        row0 = block * BLOCK_N
        w_tiles = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        x_tiles = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(stage), count=1)
        stage_bytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes

        # rows_gemm's stream: the first weight tiles while the kernel before may still run, x after the wait.
        for stage in gl.static_range(NUM_STAGES):
            if stage < k_tiles:
                mbarrier.expect(ready.index(stage), stage_bytes)
                tma_load(w_desc, [row0, stage * BLOCK_K], ready.index(stage), w_tiles.index(stage))
        if USE_PDL:
            common.wait_for_previous_grid()
            common.launch_dependents()
        for stage in gl.static_range(NUM_STAGES):
            if stage < k_tiles:
                tma_load(x_desc, [0, stage * BLOCK_K], ready.index(stage), x_tiles.index(stage))
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        for i in range(k_tiles):
            slot = i % NUM_STAGES
            mbarrier.wait(ready.index(slot), (i // NUM_STAGES) & 1)
            acc = warpgroup_mma(w_tiles.index(slot), x_tiles.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            refill = i + NUM_STAGES
            if refill < k_tiles:
                mbarrier.expect(ready.index(slot), stage_bytes)
                tma_load(w_desc, [row0, refill * BLOCK_K], ready.index(slot), w_tiles.index(slot))
                tma_load(x_desc, [0, refill * BLOCK_K], ready.index(slot), x_tiles.index(slot))
        for stage in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(stage))

        # The projection rounded, plus the residual rounded again: add_rms_norm's sum.
        offs_n = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        mask_n, mask_m = offs_n < n, offs_m < m
        mask = mask_n[:, None] & mask_m[None, :]
        tile = offs_m[None, :] * n + offs_n[:, None]  # total.T's tile in total
        if HAS_BIAS:
            acc += gl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(gl.float32)[:, None]
        dtype: gl.constexpr = total_ptr.dtype.element_ty
        residual = gl.load(residual_ptr + offs_m[None, :] * stride_residual_m + offs_n[:, None], mask=mask, other=0.0)
        total = (residual.to(gl.float32) + acc.to(dtype).to(gl.float32)).to(dtype)
        gl.store(total_ptr + tile, total, mask=mask)
        total_f32 = total.to(gl.float32)
        gl.store(squares_ptr + block * BLOCK_M + offs_m, gl.sum(total_f32 * total_f32, axis=0))

        # Every warp's stores before the count; release: they are visible to whoever acquires it.
        common.partition_barrier()
        gl.atomic_add(flags_ptr, 1, sem="release")
        done = gl.atomic_add(flags_ptr, 0, sem="acquire")
        while done < blocks:
            done = gl.atomic_add(flags_ptr, 0, sem="acquire")
        # The last program past the wait zeroes both counts for the next launch: every block is counted by then.
        if gl.atomic_add(flags_ptr + 1, 1, sem="relaxed") == blocks - 1:
            gl.atomic_xchg(flags_ptr, 0)
            gl.atomic_xchg(flags_ptr + 1, 0)

        # rms_norm of each row from the blocks' sums, each program its own block: LlamaRMSNorm's two roundings.
        sums: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])
        offs_block = gl.arange(0, BLOCKS_PAD, layout=gl.SliceLayout(1, sums))
        offs_row = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, sums))
        squares = gl.load(
            squares_ptr + offs_block[:, None] * BLOCK_M + offs_row[None, :],
            mask=(offs_block < blocks)[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        inv_rms = gl.rsqrt(gl.convert_layout(gl.sum(squares, axis=0), gl.SliceLayout(0, mma)) / n + eps)
        normalized = (total_f32 * inv_rms[None, :]).to(dtype)
        norm_weight = gl.load(norm_weight_ptr + offs_n, mask=mask_n, other=0.0).to(gl.float32)
        gl.store(normed_ptr + tile, (norm_weight[:, None] * normalized.to(gl.float32)).to(dtype), mask=mask)

    _launch_tma_rows_gemm_norm = CachedLauncher(_tma_rows_gemm_norm_kernel)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether one launch takes it: ``rows_gemm``'s TMA kernel takes ``x @ weight.T``, N is whole ``BLOCK_N`` blocks,
    at most ``MAX_BLOCKS`` of them and at most one per SM (every program waits for all of them)."""
    n = weight.shape[0]
    if not tma_rows_gemm.supports(x, weight) or n % BLOCK_N or n // BLOCK_N > MAX_BLOCKS:
        return False
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return n // BLOCK_N <= _multiprocessors(device)


def tma_rows_gemm_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    total: torch.Tensor,
    normed: torch.Tensor,
    num_stages: int | None = None,
) -> None:
    """``x`` ``[M, K]`` and ``weight`` ``[N, K]`` as :func:`supports` takes them, ``bias`` ``[N]`` or None,
    ``residual`` ``[M, N]`` with unit stride along N, ``norm_weight`` ``[N]``; writes ``total`` and ``normed``
    (``[M, N]`` contiguous). The ring is ``rows_gemm``'s for the same weight; ``num_stages`` overrides it (probes)."""
    (m, k), n = x.shape, weight.shape[0]
    config = tma_rows_gemm.tma_rows_gemm_config(k, False)
    if config["split_k"] != 1:  # K past 2048: rows_gemm would split it, this kernel streams it whole
        config = dict(config, num_stages=6)
    k_tiles = k // BLOCK_K
    squares = scratch_buffer("rows_gemm_norm_squares", MAX_BLOCKS * MAX_ROWS, torch.float32, x.device)
    flags = scratch_buffer("rows_gemm_norm_flags", 2, torch.int32, x.device)
    x_desc = common.TensorDescriptor.from_tensor(
        x, [MAX_ROWS, BLOCK_K], tma_rows_gemm._shared_layout(x.dtype, MAX_ROWS)
    )
    use_pdl = uses_programmatic_launch(x.device)
    _launch_tma_rows_gemm_norm(
        (n // BLOCK_N, 1, 1),
        (
            total, normed, tma_rows_gemm._weight_descriptor(weight), x_desc, bias if bias is not None else total,
            residual, norm_weight, squares, flags, m, n, residual.stride(0), float(eps), k_tiles,
        ),
        dict(
            NUM_STAGES=min(num_stages or config["num_stages"], k_tiles),
            BLOCKS_PAD=triton.next_power_of_2(n // BLOCK_N), HAS_BIAS=bias is not None, USE_PDL=use_pdl,
        ),
        num_warps=4,
        num_stages=1,
        launch_pdl=use_pdl,
    )  # fmt: skip
