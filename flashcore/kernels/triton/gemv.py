"""A one-row GEMV, ``out = x @ weight.T (+ bias)``, for the projections of a batch-1 decode step.

At one token per step each projection reads its whole weight once, so the step is a chain of weight streams. cuBLAS's
GEMV is as fast as a plain Triton loop in isolation (``benchmarks/NOTES.md``, entry 44), but inside a step it waits
for the kernel before it to finish before it starts loading, and the kernel after it waits for it in turn. This
kernel launches with programmatic dependent launch (PDL) and loads its first weight tile *before* ``gdc_wait``: the
weight does not depend on the kernel before it (a norm, the attention's merge), so those loads are in flight while
that kernel still runs (entry 53). The weight must therefore not be written by the kernel just before; parameters
never are.

Each program owns ``BLOCK_N`` outputs and walks K in ``BLOCK_K`` steps, accumulating ``w * x`` elementwise in fp32;
one reduction per output at the end, then the bias, then one rounding to the output dtype. The epilogue's other
operands (the residual, the rotary rows) are loaded right after the K loop, before that reduction: loaded where they
are used, each was a memory latency in series at the end of the kernel, 6-8 µs a B=1 step (entry 58).

Four options fold the decoder layer's neighbouring work into the GEMV, each one launch fewer per use:

- ``residual``: adds a residual to the rounded output and rounds again, HF's ``residual + o_proj(x)`` (and
  ``+ down_proj(...)``);
- ``up``: the input row is ``silu(x) * up`` with ``silu_and_mul``'s roundings (``layer_kernels.py``), computed per
  K step from the gate and up rows: the down projection of a SwiGLU MLP, without its input written and read back;
- ``norm_weight``: the input row is ``rms_norm(x, norm_weight, eps)`` with the norm's roundings: every program sums
  the row's squares itself (the row is K values, a few KB read from L2), then normalizes each K step as it reads
  it. The q/k/v and gate/up projections take their layer's RMSNorm this way. The sum runs in K-step chunks, not in
  the norm kernel's order, so an input value may round the other way than ``rms_norm``'s;
- ``cos``/``sin``: the first ``rotated`` outputs are heads that get the rotary embedding, rounded as
  ``layer_kernels.py``'s RoPE kernel rounds (HF's, to the bit): the q/k/v projection of a decode step, without
  RoPE's launch. A program that rotates owns ``BLOCK_N / 2`` rows of a head's first half and their partners
  ``D / 2`` rows on (:func:`rotary_rows`), so each output's partner in ``rotate_half`` is in its registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch
from flashcore.kernels.triton.layer_kernels import rms_normalize, rotate_halves, silu_and_mul


@triton.jit
def _inverse_rms(first, x_ptr, k, eps, BLOCK_K: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` of the ``[K]`` row in fp32, given its first ``BLOCK_K`` values (in registers)."""
    squares = first.to(tl.float32) * first.to(tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for start in range(BLOCK_K, k, BLOCK_K):
        x = tl.load(x_ptr + start + offs_k, mask=start + offs_k < k, other=0.0).to(tl.float32)
        squares += x * x
    return tl.rsqrt(tl.sum(squares, axis=0) / k + eps)


@triton.jit
def _gemv_input(x, up_ptr, norm_weight_ptr, inv_rms, cols, mask_k, SWIGLU: tl.constexpr, NORM: tl.constexpr):
    """The input row at ``cols``, in fp32, from ``x`` loaded there: ``x``, ``silu(x) * up`` rounded as
    ``silu_and_mul`` rounds, or ``x`` normalized as ``rms_norm`` does with ``inv_rms``."""
    if SWIGLU:
        x = silu_and_mul(x, tl.load(up_ptr + cols, mask=mask_k, other=0.0))
    if NORM:
        x = rms_normalize(x, inv_rms, tl.load(norm_weight_ptr + cols, mask=mask_k, other=0.0))
    return x.to(tl.float32)


@triton.jit
def rotary_rows(BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """The rows of a program that rotates: ``BLOCK_N // 2`` consecutive rows of the first half of a head, then the
    rows ``HALF`` after each, their partners in ``rotate_half``. Over the programs, each rotated row once."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    r = tl.arange(0, BLOCK_N)
    pair = tl.program_id(0) * PAIRS + r % PAIRS
    return (pair // HALF) * (2 * HALF) + pair % HALF + (r // PAIRS) * HALF


@triton.jit
def _epilogue_operands(
    residual_ptr, cos_ptr, sin_ptr, offs_n, mask_n, HAS_RESIDUAL: tl.constexpr, ROTARY: tl.constexpr,
    BLOCK_N: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """``(residual, cos_lo, cos_hi, sin_lo, sin_hi)``: what the epilogue reads besides the products (0.0 for what the
    switches leave out): the residual at ``offs_n``, and the rotary rows of the pairs a rotating program owns, in
    :func:`rotary_rows`' order (loaded by every program; only those that rotate use them)."""
    residual = 0.0
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    cos_lo = 0.0
    cos_hi = 0.0
    sin_lo = 0.0
    sin_hi = 0.0
    if ROTARY:
        PAIRS: tl.constexpr = BLOCK_N // 2
        dims = (tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)) % HALF
        cos_lo, cos_hi = tl.load(cos_ptr + dims).to(tl.float32), tl.load(cos_ptr + HALF + dims).to(tl.float32)
        sin_lo, sin_hi = tl.load(sin_ptr + dims).to(tl.float32), tl.load(sin_ptr + HALF + dims).to(tl.float32)
    return residual, cos_lo, cos_hi, sin_lo, sin_hi


@triton.jit
def _rotate_pairs(out, cos_lo, cos_hi, sin_lo, sin_hi, BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    """``out`` (rounded, in :func:`rotary_rows`' order) rotated with ``layer_kernels.rotate_halves``, as the RoPE
    kernel rotates it, by the rows :func:`_epilogue_operands` loaded."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    lo, hi = tl.split(tl.trans(tl.reshape(out, (2, PAIRS))))
    out_lo, out_hi = rotate_halves(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi, EXACT)
    return tl.reshape(tl.trans(tl.join(out_lo, out_hi)), (BLOCK_N,))


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]; the gate row when SWIGLU
    up_ptr,  # [K]; read only when SWIGLU
    norm_weight_ptr,  # [K]; read only when NORM
    weight_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N]; read only when HAS_BIAS
    residual_ptr,  # [N]; read only when HAS_RESIDUAL
    cos_ptr,  # [D]; read only when ROTARY
    sin_ptr,  # [D]; read only when ROTARY
    out_ptr,  # [N]
    n,
    k,
    stride_weight_n,
    eps,  # the norm's; used only when NORM
    rotated,  # outputs [0, rotated) are heads of D = 2 * HALF to rotate; used only when ROTARY
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROTARY: tl.constexpr,
    HALF: tl.constexpr,  # D / 2; used only when ROTARY
    EXACT_ROTARY: tl.constexpr,  # layer_kernels.rotate_halves' EXACT
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if ROTARY:
        offs_n = tl.where(tl.program_id(0) * BLOCK_N < rotated, rotary_rows(BLOCK_N, HALF), offs_n)
    mask_n = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    weight_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_weight_n

    # stage 1: the first weight tile, loaded while the kernel before may still run
    mask_k = offs_k < k
    w = tl.load(weight_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    if USE_PDL:
        gdc_wait()  # x comes from the kernel before
        gdc_launch_dependents()
    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
    inv_rms = 1.0
    if NORM:
        inv_rms = _inverse_rms(x, x_ptr, k, eps, BLOCK_K)
    acc = w.to(tl.float32) * _gemv_input(x, up_ptr, norm_weight_ptr, inv_rms, offs_k, mask_k, SWIGLU, NORM)[None, :]

    # stage 2: the rest of K
    for start in range(BLOCK_K, k, BLOCK_K):
        cols = start + offs_k
        mask_k = cols < k
        w = tl.load(weight_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=mask_k, other=0.0)
        acc += w.to(tl.float32) * _gemv_input(x, up_ptr, norm_weight_ptr, inv_rms, cols, mask_k, SWIGLU, NORM)[None, :]

    # epilogue: its loads first, so that their latency overlaps the reduction (entry 58)
    residual, cos_lo, cos_hi, sin_lo, sin_hi = _epilogue_operands(
        residual_ptr, cos_ptr, sin_ptr, offs_n, mask_n, HAS_RESIDUAL, ROTARY, BLOCK_N, HALF
    )
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    out = out.to(out_ptr.dtype.element_ty)
    if ROTARY:
        if tl.program_id(0) * BLOCK_N < rotated:
            out = _rotate_pairs(out, cos_lo, cos_hi, sin_lo, sin_hi, BLOCK_N, EXACT_ROTARY)
    if HAS_RESIDUAL:
        out = (out.to(tl.float32) + residual).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n, out, mask=mask_n)


_launch_gemv = CachedLauncher(_gemv_kernel)


BLOCK_N = 8  # outputs per program; a rotated head's D must be a multiple of it


def gemv_config(n: int, k: int) -> dict:
    """``block_n``, ``block_k`` and ``num_warps`` for an ``[n, k]`` weight: 8 outputs per program, K in steps of 1024
    at 4 warps, or of 2048 at 8 warps where K is longer than 2048; 64 fp32 accumulators per thread either way.

    From ``benchmarks/probes/gemv_configs_in_chain.py`` (entry 54) on the Llama-3.2-1B shape's projections, each
    GEMV after a norm as in a decode step: the best of the tiles tried (6 at K 2048, 10 at K 8192) on q/k/v, gate/up
    and down, 0.15 µs behind the best on o. With 128 accumulators per thread (8 x 2048 at 4 warps) q/k/v took 1.2 µs
    longer and the down projection twice as long. The GEMVs that compute the RMSNorm take these tiles too, and read
    the row twice (the sum of squares, then the products): at 4 warps four programs fit an SM, so the q/k/v GEMV's
    384 programs run in one wave. In a compiled B=1 session that was 15 µs per step faster than one K step of 2048
    at 8 warps (two programs an SM, 1.45 waves), and 19 µs with gate/up on these tiles too (H100,
    ``benchmarks/probes/session_gemv_tiles_b1.py``, entry 57; the probes keep those whole-row tiles as
    ``harness.gemv_whole_row_config``)."""
    block_k = min(triton.next_power_of_2(k), 1024 if k <= 2048 else 2048)
    return dict(block_n=BLOCK_N, block_k=block_k, num_warps=4 if k <= 2048 else 8)


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: dict | None = None,
    *,
    up: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rotated: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[K]`` contiguous, ``weight`` ``[N, K]`` with unit stride along K, ``bias`` ``[N]`` or None; returns
    ``out`` (``[N]`` contiguous of ``x``'s dtype; a new one if None). With ``up`` (``[K]`` contiguous) the input is
    ``silu(x) * up``; with ``norm_weight`` (``[K]``) it is ``rms_norm(x, norm_weight, eps)``; with ``residual``
    (``[N]`` contiguous) that is added to the output; with ``cos`` and ``sin`` (one row of D each, unit stride) the
    outputs ``[0, rotated)``, heads of D with ``rotated`` a multiple of D and D of ``block_n``, get the rotary
    embedding.
    ``config`` overrides :func:`gemv_config` (probes sweep it; it may also set ``num_stages``, 1 otherwise, and
    ``maxnreg``)."""
    n, k = weight.shape
    if out is None:
        out = torch.empty(n, dtype=x.dtype, device=x.device)
    config = config or gemv_config(n, k)
    use_pdl = uses_programmatic_launch(x.device)
    unused = out  # stands in for the pointers the constexpr switches keep the kernel from reading
    _launch_gemv(
        (triton.cdiv(n, config["block_n"]), 1, 1),
        (
            x, up if up is not None else unused, norm_weight if norm_weight is not None else unused, weight,
            bias if bias is not None else unused, residual if residual is not None else unused,
            cos if cos is not None else unused, sin if sin is not None else unused, out, n, k, weight.stride(0),
            float(eps), rotated,
        ),
        dict(
            BLOCK_N=config["block_n"], BLOCK_K=config["block_k"], SWIGLU=up is not None,
            NORM=norm_weight is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
            ROTARY=cos is not None, HALF=cos.shape[-1] // 2 if cos is not None else 1, EXACT_ROTARY=x.is_cuda,
            USE_PDL=use_pdl,
        ),
        num_warps=config["num_warps"],
        num_stages=config.get("num_stages", 1),
        launch_pdl=use_pdl,
        maxnreg=config.get("maxnreg"),
    )  # fmt: skip
    return out
