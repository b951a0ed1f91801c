"""flashcore's few-row GEMM (``flashcore/kernels/triton/rows_gemm.py``) against fp64 ``x @ weight.T + bias``.

The kernel multiplies on tensor cores with fp32 accumulation (IEEE fp32 for fp32 inputs) and rounds once, so the
bound is half an ulp of the dtype plus fp32's summation error over K terms, as for the one-row GEMV.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, randn

from flashcore.kernels.triton.rows_gemm import MAX_ROWS, rows_gemm_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, n, k", [(2, 1, 16), (3, 37, 100), (MAX_ROWS, 300, 700), (7, 20, 2500)]
)  # K 700 and 2500: more than one BLOCK_K step, and a ragged last one; N 37 and 300: a ragged last tile
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_rows_gemm_matches_fp64_linear(m, n, k, with_bias, dtype, device, generator):
    """The rows are a column slice of a wider tensor (row stride past K) and the weight a row slice of a wider one,
    as a fused projection's is."""
    x = randn((m, k + 5), generator=generator, dtype=dtype, device=device)[:, 2 : 2 + k]
    wide = randn((n + 7, k), generator=generator, dtype=dtype, device=device) / k**0.5
    weight = wide[3 : 3 + n]
    bias = randn((n,), generator=generator, dtype=dtype, device=device) if with_bias else None

    out = rows_gemm_triton(x, weight, bias)

    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    x64, weight64 = x.double(), weight.double()
    expected = x64 @ weight64.T + (bias.double() if with_bias else 0)
    bound = torch.finfo(dtype).eps / 2 * expected.abs() + k * torch.finfo(torch.float32).eps * (
        x64.abs() @ weight64.abs().T
    )
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), f"worst excess {float((error - bound).max())}"
