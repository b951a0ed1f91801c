"""Issue 29: the o projection of a B=16 replayed step on the TMA few-row GEMM at 32 weight rows a program
(``half_rows``: 64 programs, each MMA tile half zeros) against the 64 rows a program that ship (32 programs).

The o projection (8.4 MB) streams from 32 of the H100's 132 SMs and advances the step by 5.9-7.0 µs a layer, against
2.8 at the copy (entry 72's profile). With ``half_rows`` twice as many SMs stream it, each half the bytes a stage.
Before the sessions, the probe checks that ``half_rows`` gives the bits of the shipped kernel on the o projection's
shape (``report``). This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and
``layer_kernels``, no compile) on ``bench_generate``'s model (bf16, 16 random 512-token prompts), the variants
alternating over ``--rounds`` rounds. Per variant: µs per replayed step and the first step where row 0's 32 tokens
part from ``shipped``'s.

    python benchmarks/probes/session_o_half_rows_b16.py --out session_o_half_rows_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import rows_gemm as tma  # noqa: E402

O_PROJ = (2048, 2048)
VARIANTS = {  # name: (half_rows on the o projection, its ring; None: the shipped ring)
    "shipped": (False, None),
    "half_rows": (True, None),
    "half_rows_ring8": (True, 8),
    "half_rows_ring4": (True, 4),
}
REPORT: dict = {}


def check_bits() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, O_PROJ[1], generator=generator).to("cuda", torch.bfloat16)
    weight = (torch.randn(*O_PROJ, generator=generator) / O_PROJ[1] ** 0.5).to("cuda", torch.bfloat16)
    residual = torch.randn(16, O_PROJ[0], generator=generator).to("cuda", torch.bfloat16)
    for rows in (16, 5):
        full = tma.tma_rows_gemm(x[:rows], weight, None, residual=residual[:rows])
        half = tma.tma_rows_gemm(x[:rows], weight, None, residual=residual[:rows], half_rows=True)
        REPORT[f"half_rows_bits_equal_{rows}_rows"] = bool(torch.equal(full, half))


def timed_session(model, input_ids, half_rows: bool, num_stages: int | None) -> dict:
    if not REPORT:
        check_bits()
    run = tma.tma_rows_gemm

    def o_half_rows(x, weight, bias, *, swiglu=False, **rest):
        if tuple(weight.shape) == O_PROJ and not swiglu:
            rest = dict(rest, half_rows=half_rows, num_stages=num_stages)
        return run(x, weight, bias, swiglu=swiglu, **rest)

    tma.tma_rows_gemm = o_half_rows
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        tma.tma_rows_gemm = run


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16, report=REPORT)


if __name__ == "__main__":
    main()
