"""Issue 29: gate/up with the SiLU-and-mul on the TMA few-row GEMM at 32 outputs a program, in a B=16 step.

Since entry 72 the fused gate/up projection of a B=16 step runs on ``kernels/gluon_sm90/rows_gemm.py`` with the
SiLU-and-mul in its epilogue: each program owns 64 outputs, streams their 64 gate rows and 64 up rows (two MMAs a
K tile, a ring of 2 stages of 32 KB), one K slice, 128 programs on the H100's 132 SMs, at 2.4-2.6 TB/s. Here
(``tma_rows_gemm(pairs=True)``) a program owns 32 outputs: its 64-row MMA tile holds their 32 gate rows and 32 up
rows (two TMA boxes of 32 rows a stage), and the two halves meet through shared memory in the epilogue. Twice the
programs (256), each with half the weight and a ring of 16 KB stages, so that two fit on an SM and more bytes are
in flight per SM.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts), the variants alternating over ``--rounds`` rounds:
``shipped`` and ``pairs_st<ring>``. The report says, per variant, whether the first gate/up call's output had the
bits of the shipped kernel's on the same input (the same products, summed in the same order, should give them).

    python benchmarks/probes/session_tma_swiglu_pairs_b16.py --out session_tma_swiglu_pairs_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import torch  # noqa: E402

from flashcore.kernels.gluon_sm90 import rows_gemm as tma  # noqa: E402

VARIANTS = {"shipped": (None,), "pairs_st4": (4,), "pairs_st3": (3,), "pairs_st6": (6,), "pairs_st2": (2,)}
REPORT: dict = {"bits_equal_to_shipped": {}}


def timed_session(model, input_ids, ring: int | None) -> dict:
    run = tma.tma_rows_gemm

    def with_pairs(x, weight, bias, *, swiglu=False, **rest):
        if not swiglu or ring is None:
            return run(x, weight, bias, swiglu=swiglu, **rest)
        out = run(x, weight, bias, swiglu=True, pairs=True, num_stages=ring, **rest)
        name = f"pairs_st{ring}"
        if name not in REPORT["bits_equal_to_shipped"] and not torch.cuda.is_current_stream_capturing():
            shipped = run(x, weight, bias, swiglu=True, pairs=False)
            REPORT["bits_equal_to_shipped"][name] = bool(torch.equal(out, shipped))
        return out

    tma.tma_rows_gemm = with_pairs
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        tma.tma_rows_gemm = run


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16, report=REPORT)


if __name__ == "__main__":
    main()
