"""A few-row GEMM, ``out = x @ weight.T (+ bias)`` for ``x`` of 2-16 rows, on tensor cores, under PDL.

A decode step of B rows (B <= 16) reads every projection's weight once, as the one-row GEMV (``gemv.py``) does at
B=1, but now each weight element meets B inputs: a ``tl.dot`` of the rows (padded to 16) with a weight tile. The
launch follows the GEMV's: programmatic dependent launch, the first weight tile loaded *before* ``gdc_wait`` (the
weight does not depend on the kernel before; ``x`` does), the dependents released right after the wait. Each
program owns ``BLOCK_N`` outputs of every row and walks K in ``BLOCK_K`` steps, Triton's pipeliner keeping
``num_stages`` tiles in flight; fp32 accumulation, the bias added in fp32, one rounding to the output dtype (fp32
inputs multiply in IEEE fp32, not TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch

BLOCK_M = 16  # the rows, padded: tl.dot's smallest tile
MAX_ROWS = BLOCK_M


@triton.jit
def _rows_gemm_kernel(
    x_ptr,  # [M, K], unit stride along K
    weight_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N]; read only when HAS_BIAS
    out_ptr,  # [M, N], contiguous
    m,
    n,
    k,
    stride_x_m,
    stride_weight_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs; None: tl.dot's default (fp16/bf16)
    USE_PDL: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < m, offs_n < n
    weight_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_weight_n
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x_m

    # stage 1: the first weight tile, loaded while the kernel before may still run
    mask_k = offs_k < k
    w = tl.load(weight_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    if USE_PDL:
        gdc_wait()  # x comes from the kernel before
        gdc_launch_dependents()
    x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), input_precision=INPUT_PRECISION)

    # stage 2: the rest of K
    for start in tl.range(BLOCK_K, k, BLOCK_K, num_stages=NUM_STAGES):
        cols = start + offs_k
        mask_k = cols < k
        w = tl.load(weight_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_rows + cols[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)

    # epilogue
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * n + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_launch_rows_gemm = CachedLauncher(_rows_gemm_kernel)


def rows_gemm_config(n: int, k: int) -> dict:
    """``block_n``, ``block_k``, ``num_warps`` and ``num_stages`` for an ``[n, k]`` weight: 16 outputs a program
    (tl.dot's smallest N, so that the small projections still spread over the SMs), K in steps of 256, four deep."""
    return dict(block_n=16, block_k=min(256, max(16, triton.next_power_of_2(k))), num_warps=4, num_stages=4)


def rows_gemm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` (M <= 16) with unit stride along K, ``weight`` ``[N, K]`` with unit stride along K, ``bias``
    ``[N]`` or None; returns ``out`` (``[M, N]`` contiguous of ``x``'s dtype; a new one if None). ``config``
    overrides :func:`rows_gemm_config` (probes sweep it)."""
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    config = config or rows_gemm_config(n, k)
    use_pdl = uses_programmatic_launch(x.device)
    _launch_rows_gemm(
        (triton.cdiv(n, config["block_n"]), 1, 1),
        (x, weight, bias if bias is not None else out, out, m, n, k, x.stride(0), weight.stride(0)),
        dict(
            BLOCK_M=BLOCK_M, BLOCK_N=config["block_n"], BLOCK_K=config["block_k"], NUM_STAGES=config["num_stages"],
            HAS_BIAS=bias is not None, INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
            USE_PDL=use_pdl,
        ),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        launch_pdl=use_pdl,
    )  # fmt: skip
    return out
