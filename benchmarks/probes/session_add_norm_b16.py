"""Issue 29: the residual add after attention and the RMSNorm before the MLP as one kernel, in a B=16 replayed step.

At more than one token a decoder layer's projections are cuBLAS GEMMs, which take no norm or residual, so with the
layer kernels a B=16 step ran the add after the o projection (an inductor or torch kernel) and the MLP's RMSNorm
(flashcore's) as two launches of about 1.5 µs each (``probes/results/decode_step_kernels_b16_3cfef37.json``).
``flashcore.layer_ops.add_rms_norm`` does both in one. This probe times a ``DecodeSession``'s replayed step
(``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model (bf16, 16 random 512-token prompts) in one
process, the variants alternating over ``--rounds`` rounds:

- ``separate`` / ``separate_compiled``: the two launches, as before (the decoder layer told that its MLP's norm is
  not flashcore's, which at 16 rows changes nothing else);
- ``fused`` / ``fused_compiled``: the one kernel, as shipped; ``_compiled`` with ``compile=True``.

Per variant: µs per replayed step (median over rounds of the median of 5 timings of ``--replays`` replays), and
the first step where row 0's 32 greedy tokens part from ``separate``'s (None: all equal; the two compute the same
bits, so None is expected).

    python benchmarks/probes/session_add_norm_b16.py --out session_add_norm_b16.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.integrations import layer_kernels  # noqa: E402

VARIANTS = {  # name: (fused, compile)
    "separate": (False, False),
    "fused": (True, False),
    "separate_compiled": (False, True),
    "fused_compiled": (True, True),
}


def timed_session(model, input_ids, fused: bool, compile: bool) -> dict:
    runs_kernel_norm = layer_kernels.runs_kernel_norm
    if not fused:
        layer_kernels.runs_kernel_norm = lambda norm: False
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True, compile=compile)
    finally:
        layer_kernels.runs_kernel_norm = runs_kernel_norm


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="separate", batch=16)


if __name__ == "__main__":
    main()
