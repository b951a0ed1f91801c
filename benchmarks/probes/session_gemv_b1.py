"""Issue 29: how much of a B=1 replayed decode step does flashcore's one-row GEMV save, against cuBLAS's?

With ``layer_kernels=True`` a one-token step runs every projection on flashcore's GEMV
(``flashcore/kernels/triton/gemv.py``), launched under programmatic dependent launch and loading its weight while
the kernel before it runs. This probe times a ``DecodeSession``'s replayed step on ``bench_generate``'s model (the
Llama-3.2-1B shape, bf16, a 512-token prompt, ``max_cache_len=2048``) in one process, the variants alternating over
``--rounds`` rounds:

- ``fused_compiled``: ``compile=True, fuse_projections=True``, no layer kernels (``bench_generate``'s
  ``flashcore_session_fused``, the fastest B=1 path before the GEMV);
- ``kernels_cublas`` / ``kernels_gemv``: ``fuse_projections`` and ``layer_kernels``, no compile, with the projections
  on ``F.linear`` (the GEMV switched off by replacing ``flashcore.layer_ops.gemv`` with ``F.linear`` in this process)
  or on the GEMV;
- ``kernels_compiled_cublas`` / ``kernels_compiled_gemv``: the same with ``compile=True``.

Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays; the context grows
by 500 tokens over them), and the first step where its 32 greedy tokens part from ``kernels_gemv``'s (the GEMV sums
in another order than cuBLAS, so a near-tie may go the other way; None: all equal).

    python benchmarks/probes/session_gemv_b1.py --out benchmarks/probes/results/session_gemv_b1.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore import layer_ops  # noqa: E402

VARIANTS = {  # name: (session options, GEMV on)
    "fused_compiled": (dict(compile=True, fuse_projections=True, layer_kernels=False), True),
    "kernels_cublas": (dict(compile=False, fuse_projections=True, layer_kernels=True), False),
    "kernels_gemv": (dict(compile=False, fuse_projections=True, layer_kernels=True), True),
    "kernels_compiled_cublas": (dict(compile=True, fuse_projections=True, layer_kernels=True), False),
    "kernels_compiled_gemv": (dict(compile=True, fuse_projections=True, layer_kernels=True), True),
}


def timed_session(model, input_ids, options: dict, gemv_on: bool) -> dict:
    gemv = layer_ops.gemv
    if not gemv_on:
        layer_ops.gemv = lambda x, weight, bias=None: F.linear(x, weight, bias)
    try:
        return harness.session_steps(model, input_ids, **options)
    finally:
        layer_ops.gemv = gemv


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="kernels_gemv")


if __name__ == "__main__":
    main()
