"""Issue 29: the RMSNorm kernel releasing the next kernel before its programmatic-launch wait, in a B=16 step.

Each flashcore kernel releases the next one right after its own ``gdc_wait``. Between the o projection and the fused
gate/up projection of a B=16 decode step runs the add-and-norm kernel (16 programs); the gate/up GEMM after it loads
its first weight tiles before its own wait, but can only start once the norm has released it, which is once the o
projection has finished. With ``layer_kernels.NORM_RELEASES_FIRST`` the norm releases first, so the gate/up GEMM's
programs start, and stream their first tiles, while the o projection (32 programs) still runs. This probe times a
``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on ``bench_generate``'s
model (bf16, 16 random 512-token prompts), the variants alternating over ``--rounds`` rounds:

- ``release_first``: the norm releases before its wait (as committed at b8c0533);
- ``release_after_wait``: after it (as before, and shipped again after entry 73).

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``release_first``'s (the
bits cannot change: only when the next kernel starts does).

    python benchmarks/probes/session_norm_release_b16.py --out session_norm_release_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import layer_kernels  # noqa: E402

VARIANTS = {"release_first": (True,), "release_after_wait": (False,)}


def timed_session(model, input_ids, release_first: bool) -> dict:
    shipped = layer_kernels.NORM_RELEASES_FIRST
    layer_kernels.NORM_RELEASES_FIRST = release_first
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        layer_kernels.NORM_RELEASES_FIRST = shipped


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="release_first", batch=16)


if __name__ == "__main__":
    main()
