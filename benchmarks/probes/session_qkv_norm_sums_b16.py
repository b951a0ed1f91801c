"""Issue 29: the q/k/v projection's norm from each program's own slice of x, its sums exchanged, at B=16.

``probes/session_qkv_bounds_b16.py`` (entry 89) bounds the norm's sums of squares in the q/k/v projection at 31.8
µs a B=16 step: after its PDL wait each of the 96 programs (2 K slices of one 64 x 1024 tile) reads all 16 rows of
x (64 KB) and reduces them before its MMA. Here (``rows_gemm_config``'s ``norm_sums``) a program loads only its own
1024-wide slice, which its MMA needs anyway, and sums its squares; the two programs of a row block then exchange
their sums through global memory (each writes its own, counts itself, waits until both have, and adds the two in
slice order, so both get the same bits), and each normalizes its slice from registers. No state crosses a kernel,
unlike the sums written by the MLP (``session_norm_squares_b16.py``, −8.6 µs). The sums are added in another order
than shipped's, so a norm may round the other way.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts) in one process, the variants alternating over
``--rounds`` rounds (``harness.qkv_config_probe_main``):

- ``shipped``;
- ``own_sums``: a bound: each program's own slice's sums alone, no exchange (wrong values);
- ``exchanged``: the sums exchanged.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s. The report:
on one random q/k/v call of bench_generate's shape (16 rows, bf16), the largest difference of the shipped and the
exchanged outputs from an fp32 torch reference (norm, projection, RoPE), and from each other.

It runs at 8c30f2c only: ``norm_sums`` was taken out of the kernel after it (entry 89).

    python benchmarks/probes/session_qkv_norm_sums_b16.py --out session_qkv_norm_sums_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import rows_gemm  # noqa: E402

VARIANTS = {  # name: (the q/k/v config's overrides,)
    "shipped": (None,),
    "own_sums": (dict(norm_sums=1),),
    "exchanged": (dict(norm_sums=2),),
}
REPORT: dict = {}


def check_exchanged() -> None:
    """The report's differences, on one random call of the q/k/v shape."""
    generator = torch.Generator().manual_seed(1)
    n, k = harness.QKV_SHAPE
    head_dim, rotated, eps = 64, 2560, 1e-5
    x = (torch.randn(16, k, generator=generator) * 2).to("cuda", torch.bfloat16)
    weight = (torch.randn(n, k, generator=generator) / 45).to("cuda", torch.bfloat16)
    norm_weight = (torch.rand(k, generator=generator) + 0.5).to("cuda", torch.bfloat16)
    angles = torch.randn(16, head_dim // 2, generator=generator)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to("cuda", torch.bfloat16)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to("cuda", torch.bfloat16)
    outs = {}
    for name, overrides in (("shipped", None), ("exchanged", dict(norm_sums=2))):
        with harness.rows_gemm_config_replaced(harness.QKV_SHAPE if overrides else None, overrides or {}, True):
            outs[name] = rows_gemm.rows_gemm_triton(
                x, weight, None, norm_weight=norm_weight, eps=eps, cos=cos, sin=sin, rotated=rotated
            ).float()
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16).float()
    reference = (normed * norm_weight.float()) @ weight.float().T
    heads = reference[:, :rotated].view(16, -1, head_dim)
    lo, hi = heads[..., : head_dim // 2], heads[..., head_dim // 2 :]
    c, s = cos.float()[:, None, : head_dim // 2], sin.float()[:, None, : head_dim // 2]
    reference[:, :rotated] = torch.cat([lo * c - hi * s, hi * c + lo * s], -1).view(16, rotated)
    scale = reference.abs().max().item()
    for name, out in outs.items():
        REPORT[f"{name}_max_abs_diff_from_fp32"] = (out - reference).abs().max().item()
    REPORT["exchanged_max_abs_diff_from_shipped"] = (outs["exchanged"] - outs["shipped"]).abs().max().item()
    REPORT["reference_max_abs"] = scale
    print(REPORT, flush=True)


def main() -> None:
    check_exchanged()
    harness.qkv_config_probe_main(__doc__, VARIANTS, report=REPORT)


if __name__ == "__main__":
    main()
