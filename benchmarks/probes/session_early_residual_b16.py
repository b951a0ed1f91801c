"""Issue 29: the TMA few-row GEMM's residual tile loaded right after its PDL wait, in a B=16 replayed step.

The o projection (one launch, 32 programs) and the one-launch MLP's down projection (4 K slices, a split-K ticket)
add the residual in their epilogue: after the products (after the split-K sum, for the down projection) each
program loaded its residual tile, a round trip through L2 on the path to the output, every layer, twice. The tile
(64 outputs of 16 rows, 2 KB) depends on nothing the kernel computes, so with ``rows_gemm.EARLY_RESIDUAL`` each
program loads it right after its PDL wait and holds it in registers (8 values a thread) through its products. The
sums are the same, so are the bits.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts) in one process, the variants alternating over
``--rounds`` rounds, ``EARLY_RESIDUAL`` set while each session is built and captured:

- ``after``: the residual loaded in the epilogue, as before;
- ``early``: loaded after the wait;
- ``early_norm_weight_first``: also the RMSNorm kernel (the add-and-norm between the o projection and the MLP, and
  the final norm) loading its weight before its PDL wait, where it loaded it after the row's reduction
  (``layer_kernels.NORM_WEIGHT_FIRST``): the weight depends on no kernel.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``after``'s (None
expected: the same bits).

It runs at e651992 (c8244d4: the first two variants) only: both loads are the kernels' rule since, without the
switches (entry 90).

    python benchmarks/probes/session_early_residual_b16.py --out session_early_residual_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import rows_gemm  # noqa: E402
from flashcore.kernels.triton import layer_kernels  # noqa: E402

VARIANTS = {  # name: (rows_gemm.EARLY_RESIDUAL, layer_kernels.NORM_WEIGHT_FIRST)
    "after": (False, False),
    "early": (True, False),
    "early_norm_weight_first": (True, True),
}


def timed_session(model, input_ids, early: bool, weight_first: bool) -> dict:
    shipped = rows_gemm.EARLY_RESIDUAL, layer_kernels.NORM_WEIGHT_FIRST
    rows_gemm.EARLY_RESIDUAL, layer_kernels.NORM_WEIGHT_FIRST = early, weight_first
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        rows_gemm.EARLY_RESIDUAL, layer_kernels.NORM_WEIGHT_FIRST = shipped


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="after", batch=16)


if __name__ == "__main__":
    main()
