"""Issue 29: the o projection with the add after attention and the norm before the MLP in one launch
(``kernels/gluon_sm90/rows_gemm_norm.py``) against the two launches that ship (the TMA few-row GEMM, then the
add-and-norm kernel), in a B=16 replayed step.

The one-launch kernel's 32 programs (120 KB of shared memory each at a ring of 6, as the o projection's own
launch) compute the o projection's blocks plus the residual, count them, wait until all 32 are counted, and each
normalizes its own block. This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and
``layer_kernels``, no compile) on ``bench_generate``'s model (bf16, 16 random 512-token prompts), the variants
alternating over ``--rounds`` rounds, each set while the session is built and captured (``layer_ops.FOLD_O_NORM``
and the ring). Per variant: µs per replayed step and the first step where row 0's 32 tokens part from
``two_launches``'.

    python benchmarks/probes/session_o_norm_b16.py --out session_o_norm_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore import layer_ops  # noqa: E402
from flashcore.kernels.gluon_sm90 import rows_gemm_norm  # noqa: E402

VARIANTS = {  # name: (one launch, its ring; None: the o projection's)
    "two_launches": (False, None),
    "one_launch": (True, None),
    "one_launch_ring4": (True, 4),
    "one_launch_ring8": (True, 8),
}


def timed_session(model, input_ids, fold: bool, num_stages: int | None) -> dict:
    run, switch = rows_gemm_norm.tma_rows_gemm_norm, layer_ops.FOLD_O_NORM

    def with_ring(*args, **kwargs):
        return run(*args, num_stages=num_stages, **kwargs)

    rows_gemm_norm.tma_rows_gemm_norm, layer_ops.FOLD_O_NORM = with_ring, fold
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        rows_gemm_norm.tma_rows_gemm_norm, layer_ops.FOLD_O_NORM = run, switch


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="two_launches", batch=16)


if __name__ == "__main__":
    main()
