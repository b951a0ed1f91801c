"""A few-row GEMM, ``out = x @ weight.T (+ bias)`` for up to 16 rows, on tensor cores: the q/k/v projection (with the
RMSNorm before it and the RoPE after it), the down projection (with the SiLU-and-mul before it and the residual add
after it) and the LM head of a decode step of a few rows.

At 16 rows a projection is still a weight stream: 16 products per weight element. cuBLAS's 16-row kernels reach
2.0 TB/s on the down projection of the Llama-3.2-1B shape and 2.78 on its LM head, where the copy runs at 3.0
(``benchmarks/NOTES.md``, entry 61); they take neither the SiLU-and-mul before the down projection nor the residual
add after it, two launches of their own per layer. This kernel takes both. It is a probe's kernel made an op:
entry 61's split-K GEMM with the weight on the MMA's wide side, the layout of cuBLAS's small-batch kernels.

- Each program computes ``out.T`` for ``BLOCK_N`` weight rows (the MMA's M side) and the 16 rows, padded (its N
  side), over one slice of K. A projection is cut into as many K slices as it takes to give every SM a program
  (:func:`rows_gemm_config`); the LM head's 2004 row blocks need no split.
- The launch is the GEMV's (``gemv.py``): programmatic dependent launch, each program's first weight tile loaded
  before ``gdc_wait``, the next kernel released right after it.
- With ``up`` the input is ``silu_and_mul(x, up)`` with ``layer_kernels.silu_and_mul``'s roundings, computed per
  K tile from the gate and up rows (every row block recomputes its slice: 16 rows, from L2).
- Split K: each program stores its fp32 partial, and the last of a row block's programs to take the block's ticket
  (as the ``seq_lens`` ticket of ``split_merge.py``) adds the partials in K order. So the sum does not depend on
  which program finishes last, and a step gives the same bits every time.
- With ``norm_weight`` the input is ``rms_norm(x, norm_weight, eps)`` as the GEMV computes it (``gemv.py``): every
  program sums its rows' squares over all of K first (16 rows of K values, from L2), then normalizes each K tile as
  it reads it, with the norm's roundings.
- With ``cos``/``sin`` the outputs ``[0, rotated)`` are heads that get each row's rotary embedding, rounded as the
  RoPE kernel rounds (HF's, to the bit). A program that rotates owns ``BLOCK_N / 2`` rows of heads' first halves and
  their partners (``gemv.rotary_rows``), so both halves of each pair are in its tile.
- The epilogue rounds as HF's code does: the products summed in fp32 plus the bias, rounded once; then, with
  ``residual``, the rounded output plus the residual, rounded again (``residual + down_proj(x)``).

Its summation order is not cuBLAS's, so a model's tokens may part from the same model's on cuBLAS at a near-tie;
every path of a model with the layer kernels (eager, replayed, compiled) runs this kernel at the same rows, so they
agree with each other.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashcore.kernels.configs import num_sms
from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch
from flashcore.kernels.scratch import scratch_buffer
from flashcore.kernels.triton.gemv import rotary_rows
from flashcore.kernels.triton.layer_kernels import rms_normalize, rotate_halves, silu_and_mul

MAX_ROWS = 16  # the MMA's N side, padded to it
BLOCK_N = 64  # weight rows per program; the outputs it rotates come in whole programs of them


@triton.jit
def _inverse_rms_rows(x_cols, mask_m, k, eps, BLOCK_K: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` in fp32 of each of the rows (``[BLOCK_M]``), summed in ``BLOCK_K`` steps of K."""
    offs_k = tl.arange(0, BLOCK_K)
    x = tl.load(x_cols + offs_k[:, None], mask=(offs_k < k)[:, None] & mask_m[None, :], other=0.0).to(tl.float32)
    squares = x * x
    for start in range(BLOCK_K, k, BLOCK_K):
        cols = start + offs_k
        x = tl.load(x_cols + cols[:, None], mask=(cols < k)[:, None] & mask_m[None, :], other=0.0).to(tl.float32)
        squares += x * x
    return tl.rsqrt(tl.sum(squares, axis=0) / k + eps)


@triton.jit
def _input_tile(
    x_cols, up_cols, norm_weight_ptr, inv_rms, cols, mask_k, mask_m, SWIGLU: tl.constexpr, NORM: tl.constexpr
):
    """The input's ``[BLOCK_K, BLOCK_M]`` tile at ``cols``: ``x``, ``silu_and_mul(x, up)`` where ``SWIGLU``, or
    ``x`` normalized as ``rms_norm`` does with the rows' ``inv_rms`` where ``NORM``."""
    mask = mask_k[:, None] & mask_m[None, :]
    x = tl.load(x_cols + cols[:, None], mask=mask, other=0.0)
    if SWIGLU:
        x = silu_and_mul(x, tl.load(up_cols + cols[:, None], mask=mask, other=0.0))
    if NORM:
        norm_weight = tl.load(norm_weight_ptr + cols, mask=mask_k, other=0.0)
        x = rms_normalize(x, inv_rms[None, :], norm_weight[:, None])
    return x


@triton.jit
def _rotate_tile(
    out, cos_ptr, sin_ptr, offs_m, mask_m, stride_cos_m, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
    EXACT: tl.constexpr,
):  # fmt: skip
    """``out`` (rounded, ``[BLOCK_N, BLOCK_M]``, its weight rows in ``gemv.rotary_rows``' order: the first halves'
    rows of ``BLOCK_N / 2`` pairs, then their partners) rotated with ``layer_kernels.rotate_halves`` by each row's
    cos and sin, as the RoPE kernel rotates it."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    BLOCK_M: tl.constexpr = out.shape[1]
    dims = (tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)) % HALF
    cos_rows = cos_ptr + offs_m[None, :] * stride_cos_m + dims[:, None]
    sin_rows = sin_ptr + offs_m[None, :] * stride_cos_m + dims[:, None]
    mask = mask_m[None, :]
    cos_lo = tl.load(cos_rows, mask=mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_rows + HALF, mask=mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_rows, mask=mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_rows + HALF, mask=mask, other=0.0).to(tl.float32)
    lo, hi = tl.split(tl.permute(tl.reshape(out, (2, PAIRS, BLOCK_M)), (1, 2, 0)))
    out_lo, out_hi = rotate_halves(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi, EXACT)
    return tl.reshape(tl.permute(tl.join(out_lo, out_hi), (2, 0, 1)), (BLOCK_N, BLOCK_M))


@triton.jit
def _store_output(
    total, bias_ptr, residual_ptr, cos_ptr, sin_ptr, out_ptr, offs_n, offs_m, mask_n, mask_m, n, stride_residual_m,
    stride_cos_m, rotates, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HALF: tl.constexpr,
    EXACT_ROTARY: tl.constexpr,
):  # fmt: skip
    """``total`` (fp32, ``[BLOCK_N, BLOCK_M]``, out.T's tile) plus the bias, rounded; rotated where ``rotates``;
    plus the residual, rounded."""
    BLOCK_N: tl.constexpr = total.shape[0]
    mask = mask_n[:, None] & mask_m[None, :]
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    out = total.to(out_ptr.dtype.element_ty)
    if rotates:
        out = _rotate_tile(out, cos_ptr, sin_ptr, offs_m, mask_m, stride_cos_m, BLOCK_N, HALF, EXACT_ROTARY)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offs_m[None, :] * stride_residual_m + offs_n[:, None], mask=mask, other=0.0)
        out = (out.to(tl.float32) + residual.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[None, :] * n + offs_n[:, None], out, mask=mask)


@triton.jit
def _rows_gemm_kernel(
    x_ptr,  # [M, K], unit stride along K; the gate rows when SWIGLU
    up_ptr,  # [M, K], unit stride along K; read only when SWIGLU
    weight_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N]; read only when HAS_BIAS
    residual_ptr,  # [M, N], unit stride along N; read only when HAS_RESIDUAL
    norm_weight_ptr,  # [K]; read only when NORM
    cos_ptr,  # [M, D] (row stride stride_cos_m), unit stride along D; read only when ROTARY
    sin_ptr,  # like cos
    partial_ptr,  # [SPLIT_K, BLOCK_M, N] fp32 scratch; used only when SPLIT_K > 1
    tickets_ptr,  # [cdiv(N, BLOCK_N)] int32, zero between launches; used only when SPLIT_K > 1
    out_ptr,  # [M, N], contiguous
    m,
    n,
    k,
    stride_x_m,
    stride_up_m,
    stride_residual_m,
    stride_weight_n,
    stride_cos_m,
    k_per_split,  # a multiple of BLOCK_K
    eps,  # the norm's; used only when NORM
    rotated,  # outputs [0, rotated) are heads of D = 2 * HALF to rotate, a multiple of BLOCK_N; used only when ROTARY
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROTARY: tl.constexpr,
    HALF: tl.constexpr,  # D / 2; used only when ROTARY
    EXACT_ROTARY: tl.constexpr,  # layer_kernels.rotate_halves' EXACT
    INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs; None: tl.dot's default (fp16, bf16)
    USE_PDL: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rotates = False
    if ROTARY:
        rotates = block * BLOCK_N < rotated
        offs_n = tl.where(rotates, rotary_rows(BLOCK_N, HALF), offs_n)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < n, offs_m < m
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    weight_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_weight_n
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x_m
    up_cols = up_ptr + offs_m.to(tl.int64)[None, :] * stride_up_m

    # stage 1: the first weight tile, loaded while the kernel before may still run
    cols = k_start + tl.arange(0, BLOCK_K)
    mask_k = cols < k_end
    w = tl.load(weight_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    if USE_PDL:
        gdc_wait()  # x (and up, the residual) come from the kernels before
        gdc_launch_dependents()
    inv_rms = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM:
        inv_rms = _inverse_rms_rows(x_cols, mask_m, k, eps, BLOCK_K)
    x = _input_tile(x_cols, up_cols, norm_weight_ptr, inv_rms, cols, mask_k, mask_m, SWIGLU, NORM)
    acc = tl.dot(w, x, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), input_precision=INPUT_PRECISION)

    # stage 2: the rest of this program's slice of K
    for start in range(k_start + BLOCK_K, k_end, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        mask_k = cols < k_end
        w = tl.load(weight_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = _input_tile(x_cols, up_cols, norm_weight_ptr, inv_rms, cols, mask_k, mask_m, SWIGLU, NORM)
        acc = tl.dot(w, x, acc, input_precision=INPUT_PRECISION)

    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        _store_output(
            acc, bias_ptr, residual_ptr, cos_ptr, sin_ptr, out_ptr, offs_n, offs_m, mask_n, mask_m, n,
            stride_residual_m, stride_cos_m, rotates, HAS_BIAS, HAS_RESIDUAL, HALF, EXACT_ROTARY,
        )  # fmt: skip
    else:
        partial_tile = offs_m[None, :] * n + offs_n[:, None]  # out.T's tile in one split's [BLOCK_M, N] partial
        tl.store(partial_ptr + split * BLOCK_M * n + partial_tile, acc, mask=mask)
        # The barrier puts every warp's partial stores before the ticket, whose release then publishes them; the
        # last taker's acquire makes every program's partial visible to its loads (from L2).
        tl.debug_barrier()
        if tl.atomic_add(tickets_ptr + block, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(
                    partial_ptr + s * BLOCK_M * n + partial_tile, mask=mask, other=0.0, cache_modifier=".cg"
                )
            _store_output(
                total, bias_ptr, residual_ptr, cos_ptr, sin_ptr, out_ptr, offs_n, offs_m, mask_n, mask_m, n,
                stride_residual_m, stride_cos_m, rotates, HAS_BIAS, HAS_RESIDUAL, HALF, EXACT_ROTARY,
            )  # fmt: skip
            tl.atomic_xchg(tickets_ptr + block, 0)


_launch_rows_gemm = CachedLauncher(_rows_gemm_kernel)


@functools.cache
def rows_gemm_config(n: int, k: int, device: torch.device, norm: bool = False, element_size: int = 2) -> dict:
    """``block_n``, ``block_k``, ``split_k`` and ``num_warps`` for an ``[n, k]`` weight: 64 weight rows and 128 of K
    per tile at 4 warps, one pipeline stage, and the fewest K slices (a divisor of K's tile count) that give every
    SM a program. Entry 61's best variant on the Llama-3.2-1B shape (H100; ``probes/session_splitk_gemm_b16.py``):
    64 x 128 tiles at one stage were ahead of cuBLAS on the down projection and the LM head (2.24 and 2.99 against
    2.01 and 2.78 TB/s alone), two or three stages and 64 x 64 tiles slower, and a program per SM faster in the
    step than two. Computed once per shape: an eager call's host time is its cost.

    With the norm folded in (``norm``) a program's K slice is one tile (or whole tiles of it, where its width is not
    a power of two of 128s), the first loaded before the PDL wait, so that it streams while the norm's prologue reads
    the rows: the fewest slices of at most 1024 of K (8 warps at 1024) that give at least half the SMs a program.
    On the q/k/v projection of a B=16 step (H100,
    ``probes/session_qkv_rows_gemm_b16.py`` and ``session_rows_gemm_splits_b16.py``, entries 68 and 71), against
    cuBLAS with the norm's and RoPE's launches: 2 slices of 64 x 1024 (96 programs) 8 µs shorter than 4 of 64 x 512,
    which were 16-19 µs shorter than cuBLAS; 64 x 128 tiles 44-47 µs longer, 8 slices of 64 x 256 67 µs longer
    than 4. The tiles were fitted in bf16; a tile of 4-byte elements is at most 64 x 512 (the dot stages both
    operands in shared memory: a 64 x 1024 fp32 tile and its inputs need 320 KB, past the H100's 227 KB)."""
    block_n, block_k = BLOCK_N, 128
    blocks, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    splits = [s for s in range(1, steps + 1) if steps % s == 0]
    if norm:
        wanted = max(1, num_sms(device) // 2)
        split_k = next((s for s in splits if blocks * s >= wanted and steps // s <= 8), splits[-1])
        tiles = steps // split_k
        widest = 8 if element_size <= 2 else 4
        block_k *= next(t for t in (8, 4, 2, 1) if t <= widest and tiles % t == 0)  # whole tiles, a power of two
        return dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=8 if block_k >= 1024 else 4)
    split_k = next((s for s in splits if blocks * s >= num_sms(device)), splits[-1])
    return dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4)


def rows_gemm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    up: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rotated: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` (M <= 16) with unit stride along K, ``weight`` ``[N, K]`` likewise, ``bias`` ``[N]`` or None;
    returns ``out`` (``[M, N]`` contiguous of ``x``'s dtype; a new one if None). With ``up`` (``x``'s shape, unit
    stride along K) the input is ``silu_and_mul(x, up)``; with ``norm_weight`` (``[K]``) it is ``rms_norm(x,
    norm_weight, eps)``; with ``residual`` (``[M, N]``, unit stride along N) that is added to the rounded output; with
    ``cos`` and ``sin`` (``[M, D]`` at one row stride, unit stride along D) the outputs ``[0, rotated)``, heads of D
    with ``rotated`` a multiple of ``BLOCK_N``, get each row's rotary embedding."""
    (m, k), n = x.shape, weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    config = rows_gemm_config(n, k, x.device, norm_weight is not None, x.element_size())
    block_n, block_k, split_k = config["block_n"], config["block_k"], config["split_k"]
    k_per_split = triton.cdiv(k, block_k) // split_k * block_k
    blocks = triton.cdiv(n, block_n)
    partial, tickets = out, out  # stand-ins: one slice writes no partials
    if split_k > 1:
        partial = scratch_buffer("rows_gemm_partials", split_k * MAX_ROWS * n, torch.float32, x.device)
        tickets = scratch_buffer("rows_gemm_tickets", blocks, torch.int32, x.device)
    use_pdl = uses_programmatic_launch(x.device)
    unused = out  # stands in for the pointers the constexpr switches keep the kernel from reading
    _launch_rows_gemm(
        (blocks, split_k, 1),
        (
            x, up if up is not None else x, weight, bias if bias is not None else unused,
            residual if residual is not None else unused, norm_weight if norm_weight is not None else unused,
            cos if cos is not None else unused, sin if sin is not None else unused, partial, tickets, out, m, n, k,
            x.stride(0), up.stride(0) if up is not None else 0, residual.stride(0) if residual is not None else 0,
            weight.stride(0), cos.stride(0) if cos is not None else 0, k_per_split, float(eps), rotated,
        ),
        dict(
            BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, SWIGLU=up is not None,
            NORM=norm_weight is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
            ROTARY=cos is not None, HALF=cos.shape[-1] // 2 if cos is not None else 1, EXACT_ROTARY=x.is_cuda,
            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None, USE_PDL=use_pdl,
        ),
        num_warps=config["num_warps"],
        num_stages=1,
        launch_pdl=use_pdl,
    )  # fmt: skip
    return out
