"""A few-row GEMM on TMA copies, ``out = x @ weight.T (+ bias) (+ residual)`` for up to 16 rows (sm_90, Gluon): the
o, gate/up and down projections and the LM head of a decode step of a few rows.

The Triton few-row GEMM (``kernels/triton/rows_gemm.py``) loads its weight tiles into registers, one tile in flight
per program. At 16 rows a projection is a weight stream, and how many bytes an SM has in flight sets how fast it
streams. Here each program keeps a ring of ``NUM_STAGES`` weight tiles in shared memory, filled by TMA copies: the
first go out before the PDL wait, while the kernel before still runs, and each stage is filled again as soon as its
MMA has read it; the registers hold only the accumulator. On the Llama-3.2-1B shape's down projection at 16 rows
that took the weight stream from 1.7 TB/s to 2.2-2.5 on an H100 (benchmarks/NOTES.md, entry 72).

- Each program computes ``out.T`` for ``BLOCK_N`` weight rows (the MMA's M side) and the 16 rows (its N side; the
  TMA copy fills rows past ``M`` with zeros), over one slice of K in ``BLOCK_K`` tiles.
- With ``swiglu`` the weight is a fused gate/up projection's, the gate's rows stacked on the up's: each program
  streams the gate's and the up's rows of the same outputs, and its epilogue writes ``silu_and_mul(gate, up)``
  with ``layer_kernels.silu_and_mul``'s roundings. The down projection after it is then a plain GEMM, whose epilogue
  adds the residual.
- Split K, the epilogue's roundings (the products summed in fp32 plus the bias, rounded once; plus the residual,
  rounded again) and the ticket that fixes the order of the split sum are the Triton kernel's. A split is a
  function of K alone, so the gate's outputs of a ``swiglu`` call have the bits of the plain call's.
- A program loads its residual tile right after the PDL wait and holds it through its products, so that load's round
  trip is not on the path to the output (the o and down projections of a B=16 step: 11 µs less a replayed step,
  benchmarks/NOTES.md, entry 90).
"""

from __future__ import annotations

import functools

import torch
import triton

from flashcore.kernels.gluon_sm90 import common
from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch
from flashcore.kernels.scratch import scratch_buffer

MAX_ROWS = 16
BLOCK_N = 64  # weight rows per program: one warpgroup's MMA
BLOCK_K = 128  # K per tile: 16 KB of bf16 weight

if common.HAS_GLUON:
    from flashcore.kernels.gluon_sm90.common import gl, gluon, mbarrier, tma_load, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def _tma_rows_gemm_kernel(
        out_ptr,  # [M, N_out], contiguous (a tensor first: CachedLauncher reads the device off it)
        w_desc,  # TMA descriptor over weight [N, K], [BLOCK_N, BLOCK_K] boxes
        x_desc,  # TMA descriptor over x [M, K], [MAX_ROWS, BLOCK_K] boxes
        bias_ptr,  # [N]; read only when HAS_BIAS
        residual_ptr,  # [M, N_out], unit stride along N; read only when HAS_RESIDUAL
        partial_ptr,  # [SPLIT_K, MAX_ROWS, N] fp32; used only when SPLIT_K > 1
        tickets_ptr,  # [cdiv(N_out, BLOCK_N)] int32, zero between launches; used only when SPLIT_K > 1
        m,
        n_out,  # N, or N / 2 with SWIGLU
        stride_residual_m,
        tiles_per_split,
        SPLIT_K: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        SWIGLU: gl.constexpr,  # weight rows [0, N_out) are the gate's, [N_out, N) the up's; out = silu_and_mul
        HAS_BIAS: gl.constexpr,
        HAS_RESIDUAL: gl.constexpr,
        USE_PDL: gl.constexpr,
    ):
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        UP_STAGES: gl.constexpr = NUM_STAGES if SWIGLU else 1
        block = gl.program_id(0)
        split = gl.program_id(1)
        row0 = block * BLOCK_N
        k0 = split * tiles_per_split * BLOCK_K
        w_tiles = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        u_tiles = gl.allocate_shared_memory(w_desc.dtype, [UP_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        x_tiles = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(stage), count=1)
        stage_bytes: gl.constexpr = (2 if SWIGLU else 1) * w_desc.block_type.nbytes + x_desc.block_type.nbytes

        # The first stages' weight tiles, while the kernel before may still run; x after the wait.
        copy_weight_tiles(w_desc, w_tiles, u_tiles, ready, row0, n_out + row0, k0, tiles_per_split, stage_bytes, 0,
                          NUM_STAGES, SWIGLU)  # fmt: skip
        if USE_PDL:
            common.wait_for_previous_grid()
            common.launch_dependents()
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        offs_n = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        residual = load_residual(residual_ptr, offs_n, offs_m, m, n_out, stride_residual_m, acc, HAS_RESIDUAL)
        acc, acc_up = stream_weight_tiles(w_desc, x_desc, w_tiles, u_tiles, x_tiles, ready, row0, n_out + row0, k0,
                                          tiles_per_split, acc, NUM_STAGES, NUM_STAGES, SWIGLU)  # fmt: skip
        for stage in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(stage))

        store_output(acc, acc_up, bias_ptr, residual_ptr, out_ptr, partial_ptr, tickets_ptr, block, split, offs_n,
                     offs_m, m, n_out, stride_residual_m, SPLIT_K, SWIGLU, HAS_BIAS, HAS_RESIDUAL, residual,
                     HAS_RESIDUAL)  # fmt: skip

    # The pieces of the kernel above, which kernels/gluon_sm90/rows_mlp.py runs as well.

    @gluon.jit
    def copy_weight_tiles(w_desc, w_tiles, u_tiles, ready, row0, up_row0, k0, num_tiles, stage_bytes,
                          FIRST: gl.constexpr, NUM_STAGES: gl.constexpr, SWIGLU: gl.constexpr):  # fmt: skip
        """Starts the TMA copies of ring stages ``[FIRST, NUM_STAGES)``'s weight tiles (with ``SWIGLU`` the up rows'
        tiles too, from ``up_row0``), each stage's barrier expecting ``stage_bytes`` (the weight tiles and the x tile
        :func:`stream_weight_tiles` copies later)."""
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        for stage in gl.static_range(FIRST, NUM_STAGES):
            if stage < num_tiles:
                mbarrier.expect(ready.index(stage), stage_bytes)
                tma_load(w_desc, [row0, k0 + stage * BLOCK_K], ready.index(stage), w_tiles.index(stage))
                if SWIGLU:
                    tma_load(w_desc, [up_row0, k0 + stage * BLOCK_K], ready.index(stage), u_tiles.index(stage))

    @gluon.jit
    def stream_weight_tiles(w_desc, x_desc, w_tiles, u_tiles, x_tiles, ready, row0, up_row0, k0, num_tiles, acc,
                            NUM_STAGES: gl.constexpr, COPIED: gl.constexpr, SWIGLU: gl.constexpr):  # fmt: skip
        """``(acc + W[row0:] @ x.T, the same for W[up_row0:] with SWIGLU)`` over ``num_tiles`` K tiles from ``k0``,
        through the ring: the first ``COPIED`` stages' weight tiles are on their way (:func:`copy_weight_tiles`);
        the rest of the ring's and every x tile are copied from here, and each stage is refilled as soon as its MMA
        has read it."""
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        stage_bytes: gl.constexpr = (2 if SWIGLU else 1) * w_desc.block_type.nbytes + x_desc.block_type.nbytes
        copy_weight_tiles(w_desc, w_tiles, u_tiles, ready, row0, up_row0, k0, num_tiles, stage_bytes, COPIED,
                          NUM_STAGES, SWIGLU)  # fmt: skip
        for stage in gl.static_range(NUM_STAGES):
            if stage < num_tiles:
                tma_load(x_desc, [0, k0 + stage * BLOCK_K], ready.index(stage), x_tiles.index(stage))
        acc_up = gl.zeros_like(acc)
        for i in range(num_tiles):
            slot = i % NUM_STAGES
            mbarrier.wait(ready.index(slot), (i // NUM_STAGES) & 1)
            x_tile = x_tiles.index(slot).permute((1, 0))
            acc = warpgroup_mma(w_tiles.index(slot), x_tile, acc, is_async=True)
            if SWIGLU:
                acc_up = warpgroup_mma(u_tiles.index(slot), x_tile, acc_up, is_async=True)
                acc, acc_up = warpgroup_mma_wait(0, deps=[acc, acc_up])
            else:
                acc = warpgroup_mma_wait(0, deps=[acc])
            refill = i + NUM_STAGES
            if refill < num_tiles:
                mbarrier.expect(ready.index(slot), stage_bytes)
                tma_load(w_desc, [row0, k0 + refill * BLOCK_K], ready.index(slot), w_tiles.index(slot))
                if SWIGLU:
                    tma_load(w_desc, [up_row0, k0 + refill * BLOCK_K], ready.index(slot), u_tiles.index(slot))
                tma_load(x_desc, [0, k0 + refill * BLOCK_K], ready.index(slot), x_tiles.index(slot))
        return acc, acc_up

    @gluon.jit
    def load_residual(residual_ptr, offs_n, offs_m, m, n_out, stride_residual_m, like, LOAD: gl.constexpr):
        """The residual's tile of ``out.T`` at ``[offs_n, offs_m]`` where ``LOAD`` (``like`` otherwise, unread): loaded
        right after the PDL wait, its round trip is off the epilogue's path (:func:`store_output`'s ``LOADED``)."""
        tile = like
        if LOAD:
            mask = (offs_n < n_out)[:, None] & (offs_m < m)[None, :]
            tile = gl.load(residual_ptr + offs_m[None, :] * stride_residual_m + offs_n[:, None], mask=mask)
        return tile

    @gluon.jit
    def store_output(
        acc, acc_up, bias_ptr, residual_ptr, out_ptr, partial_ptr, tickets_ptr, block, split, offs_n, offs_m, m, n_out,
        stride_residual_m, SPLIT_K: gl.constexpr, SWIGLU: gl.constexpr, HAS_BIAS: gl.constexpr,
        HAS_RESIDUAL: gl.constexpr, residual, LOADED: gl.constexpr,
    ):  # fmt: skip
        """Writes ``out.T``'s tile ``[offs_n, offs_m]`` (``out`` ``[m, n_out]``) from this K slice's products: at one
        slice through :func:`_epilogue`; in ``SPLIT_K`` slices each writes its products to its partial, and the last
        program of the block to take the ticket adds them in K order, then runs the epilogue (the Triton kernel's
        protocol)."""
        BLOCK_M: gl.constexpr = acc.shape[1]
        mask_n, mask_m = offs_n < n_out, offs_m < m
        mask = mask_n[:, None] & mask_m[None, :]
        tile = offs_m[None, :] * n_out + offs_n[:, None]  # out.T's tile in out
        if SPLIT_K > 1:
            n = n_out * (2 if SWIGLU else 1)
            partial_tile = offs_m[None, :] * n + offs_n[:, None]  # and in one split's partial
            gl.store(partial_ptr + split * BLOCK_M * n + partial_tile, acc, mask=mask)
            if SWIGLU:
                gl.store(partial_ptr + split * BLOCK_M * n + n_out + partial_tile, acc_up, mask=mask)
            # As the Triton kernel: every warp's partial stores before the ticket; the last taker adds in K order.
            common.partition_barrier()
            if gl.atomic_add(tickets_ptr + block, 1, sem="acq_rel") == SPLIT_K - 1:
                acc = gl.zeros_like(acc)
                acc_up = gl.zeros_like(acc)
                for s in gl.static_range(SPLIT_K):
                    split_tile = partial_ptr + s * BLOCK_M * n + partial_tile
                    acc += gl.load(split_tile, mask=mask, other=0.0, cache_modifier=".cg")
                    if SWIGLU:
                        acc_up += gl.load(split_tile + n_out, mask=mask, other=0.0, cache_modifier=".cg")
                _epilogue(acc, acc_up, bias_ptr, residual_ptr, out_ptr, tile, offs_n, offs_m, mask_n, mask, n_out,
                          stride_residual_m, SWIGLU, HAS_BIAS, HAS_RESIDUAL, residual, LOADED)  # fmt: skip
                gl.atomic_xchg(tickets_ptr + block, 0)
        else:
            _epilogue(acc, acc_up, bias_ptr, residual_ptr, out_ptr, tile, offs_n, offs_m, mask_n, mask, n_out,
                      stride_residual_m, SWIGLU, HAS_BIAS, HAS_RESIDUAL, residual, LOADED)  # fmt: skip

    @gluon.jit
    def _silu_and_mul(gate, up):
        """``layer_kernels.silu_and_mul``, op for op (a Gluon kernel cannot call the @triton.jit one)."""
        dtype = gate.dtype
        gate = gate.to(gl.float32)
        activated = (gate / (1.0 + gl.exp(-gate))).to(dtype).to(gl.float32)
        return (activated * up.to(gl.float32)).to(dtype)

    @gluon.jit
    def _epilogue(
        total, total_up, bias_ptr, residual_ptr, out_ptr, tile, offs_n, offs_m, mask_n, mask, n_out,
        stride_residual_m, SWIGLU: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, residual,
        LOADED: gl.constexpr,
    ):  # fmt: skip
        """The Triton kernel's epilogue: plus the bias in fp32, rounded (with ``SWIGLU``, gate and up each, then
        ``silu_and_mul`` of the two); plus the residual, rounded again."""
        if HAS_BIAS:
            total += gl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(gl.float32)[:, None]
            if SWIGLU:
                total_up += gl.load(bias_ptr + n_out + offs_n, mask=mask_n, other=0.0).to(gl.float32)[:, None]
        out = total.to(out_ptr.dtype.element_ty)
        if SWIGLU:
            out = _silu_and_mul(out, total_up.to(out_ptr.dtype.element_ty))
        if HAS_RESIDUAL:
            if not LOADED:
                residual = gl.load(residual_ptr + offs_m[None, :] * stride_residual_m + offs_n[:, None], mask=mask)
            out = (out.to(gl.float32) + residual.to(gl.float32)).to(out_ptr.dtype.element_ty)
        gl.store(out_ptr + tile, out, mask=mask)

    _launch_tma_rows_gemm = CachedLauncher(_tma_rows_gemm_kernel)


def supports(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """Whether the kernel takes ``x @ weight.T`` (``x`` ``[M, K]``): sm_90, bf16 or fp16, both K-contiguous with
    16-byte aligned rows, K a multiple of ``BLOCK_K``, at most 16 rows; with ``swiglu``, whole programs of gate rows.
    """
    return (
        common.runs_on(x.device)
        and (not swiglu or weight.shape[0] % (2 * BLOCK_N) == 0)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.shape[1] % BLOCK_K == 0
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and (x.stride(0) * x.element_size()) % 16 == 0
        and (weight.stride(0) * weight.element_size()) % 16 == 0
        # Tracing (torch.compile) knows no addresses: the op's body asks again with the tensors it runs on.
        and (torch.compiler.is_compiling() or (x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0))
    )


MAX_TILES_PER_SPLIT = 16  # K slices of at most 2048


@functools.cache
def tma_rows_gemm_config(k: int, swiglu: bool) -> dict:
    """``split_k`` and ``num_stages`` for a weight of ``k`` columns: slices of at most 16 tiles (2048 of K), whatever
    N is, and a ring of 6 tiles (120 KB of shared memory), of 4 where K is split, of 2 with ``swiglu`` (two weight
    tiles a stage). Fitted to one model: on the Llama-3.2-1B shape's o, gate/up and down projections in a B=16
    replayed step (H100, ``probes/session_tma_rows_gemm_b16.py`` and ``session_tma_configs_b16.py``, entry 72) these
    were the fastest of the rings and splits tried, or within 3.3 µs a step of it (down in 8 slices): o one slice,
    ring 6 (4 slices, ring 4: 35 µs a step slower); gate/up with the SiLU-and-mul one slice, ring 2 (2 slices: 66 µs
    slower); down 4 slices, ring 4 (2 slices, ring 6: 25 µs slower)."""
    split_k = split_k_for(k)
    return dict(split_k=split_k, num_stages=2 if swiglu else 4 if split_k > 1 else 6)


def split_k_for(k: int) -> int:
    """:func:`tma_rows_gemm_config`'s K slices for ``k``: the fewest of at most ``MAX_TILES_PER_SPLIT`` tiles that
    divide K's tiles evenly. Not cached: ``rows_mlp.supports`` calls it in a compiled step's traced code, where
    torch.compile warns at every ``lru_cache``-wrapped function."""
    tiles = k // BLOCK_K
    split_k = triton.cdiv(tiles, MAX_TILES_PER_SPLIT)
    while tiles % split_k:
        split_k += 1
    return split_k


MAX_CACHED_DESCRIPTORS = 1024  # a model's weights: a few per layer
_weight_descriptors: dict[tuple, object] = {}


def _weight_descriptor(weight: torch.Tensor):
    """The weight's TMA descriptor, built once per address and layout: a weight lives across calls, and building a
    descriptor is most of an eager call's added host time. Keyed by what the descriptor holds (as
    ``common.cached_tile_descriptor``); it holds the address, not the tensor."""
    key = (weight.data_ptr(), weight.shape, weight.stride(), weight.dtype)
    descriptor = _weight_descriptors.get(key)
    if descriptor is None:
        if len(_weight_descriptors) >= MAX_CACHED_DESCRIPTORS:
            _weight_descriptors.clear()
        layout = _shared_layout(weight.dtype, BLOCK_N)
        base = common._DeviceAddress(weight.data_ptr(), weight.dtype)
        descriptor = common.TensorDescriptor(
            base, list(weight.shape), list(weight.stride()), [BLOCK_N, BLOCK_K], layout
        )
        _weight_descriptors[key] = descriptor
    return descriptor


@functools.cache
def _shared_layout(dtype: torch.dtype, rows: int):
    return common.gl.NVMMASharedLayout.get_default_for(
        [rows, BLOCK_K], common.gl.bfloat16 if dtype == torch.bfloat16 else common.gl.float16
    )


def tma_rows_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]``, ``weight`` ``[N, K]`` (:func:`supports`), ``bias`` ``[N]`` or None, ``residual`` ``[M, N]``
    with unit stride along N or None; returns ``out`` (``[M, N]`` contiguous, a new one if None). With ``swiglu``
    the weight's rows are a gate's and an up projection's, stacked, and ``out`` (``[M, N / 2]``) is
    ``silu_and_mul(gate, up)`` of the two products."""
    (m, k), n = x.shape, weight.shape[0]
    n_out = n // 2 if swiglu else n
    if out is None:
        out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    config = tma_rows_gemm_config(k, swiglu)
    split_k = split_k or config["split_k"]
    num_stages = num_stages or config["num_stages"]
    tiles_per_split = k // BLOCK_K // split_k
    blocks = triton.cdiv(n_out, BLOCK_N)
    partial, tickets = out, out
    if split_k > 1:
        partial = scratch_buffer("rows_gemm_partials", split_k * MAX_ROWS * n, torch.float32, x.device)
        tickets = scratch_buffer("rows_gemm_tickets", blocks, torch.int32, x.device)
    w_desc = _weight_descriptor(weight)
    x_desc = common.TensorDescriptor.from_tensor(x, [MAX_ROWS, BLOCK_K], _shared_layout(x.dtype, MAX_ROWS))
    use_pdl = uses_programmatic_launch(x.device)
    _launch_tma_rows_gemm(
        (blocks, split_k, 1),
        (
            out, w_desc, x_desc, bias if bias is not None else out, residual if residual is not None else out,
            partial, tickets, m, n_out, residual.stride(0) if residual is not None else 0, tiles_per_split,
        ),
        dict(
            SPLIT_K=split_k, NUM_STAGES=min(num_stages, tiles_per_split), SWIGLU=swiglu, HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None, USE_PDL=use_pdl,
        ),
        num_warps=4,
        num_stages=1,
        launch_pdl=use_pdl,
    )  # fmt: skip
    return out
