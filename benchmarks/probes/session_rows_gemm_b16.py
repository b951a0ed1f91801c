"""Issue 29: the down projection and the LM head on flashcore's few-row GEMM, in a B=16 replayed step.

At 16 rows a decoder layer's down projection ran on cuBLAS (a split-K GEMM and its reduce), with the SiLU-and-mul
before it and the residual add after it as two launches of their own; the LM head on cuBLAS too.
``flashcore.layer_ops.rows_gemm`` (``flashcore/kernels/triton/rows_gemm.py``) runs the down projection with both
folded in, and the LM head, as entry 61's split-K kernel. This probe times a ``DecodeSession``'s replayed step
(``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model (bf16, 16 random 512-token prompts) in one
process, the variants alternating over ``--rounds`` rounds:

- ``cublas`` / ``cublas_compiled``: the few-row GEMM off (``layer_ops.ROWS_GEMM_MAX_ROWS`` set to 1 while the
  session is built and captured), as before;
- ``rows_gemm`` / ``rows_gemm_compiled``: as shipped; ``_compiled`` with ``compile=True``;
- ``rows_gemm_o`` / ``rows_gemm_o_compiled``: the o projection on the few-row GEMM too (the fork's
  ``_project_residual`` wrapped for the session's build and capture).

Per variant: µs per replayed step (median over rounds of the median of 5 timings of ``--replays`` replays), and
the first step where row 0's 32 greedy tokens part from ``cublas``'s (the two sum in other orders, so they may part
at a near-tie of the random model).

    python benchmarks/probes/session_rows_gemm_b16.py --out session_rows_gemm_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore import layer_ops  # noqa: E402
from flashcore.integrations import llama_forward_fork as fork  # noqa: E402

VARIANTS = {  # name: (rows_gemm, compile, the o projection too)
    "cublas": (False, False, False),
    "rows_gemm": (True, False, False),
    "cublas_compiled": (False, True, False),
    "rows_gemm_compiled": (True, True, False),
    "rows_gemm_o": (True, False, True),
    "rows_gemm_o_compiled": (True, True, True),
}


def with_o_projection(project_residual):
    """The fork's ``_project_residual``, with the o projection (no ``up``) on the few-row GEMM where the down
    projection runs there."""

    def wrapped(module, x, name, residual, up=None):
        linear = getattr(module, name)
        if up is None and fork._runs_rows_gemm(module, x) and fork._is_plain_linear(linear):
            return layer_ops.rows_gemm(x, linear.weight, linear.bias, residual=residual)
        return project_residual(module, x, name, residual, up=up)

    return wrapped


def timed_session(model, input_ids, rows_gemm: bool, compile: bool, o_too: bool) -> dict:
    max_rows, project_residual = layer_ops.ROWS_GEMM_MAX_ROWS, fork._project_residual
    if not rows_gemm:
        layer_ops.ROWS_GEMM_MAX_ROWS = 1  # the fork and the LM head's forward read it per call
    if o_too:
        fork._project_residual = with_o_projection(project_residual)
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True, compile=compile)
    finally:
        layer_ops.ROWS_GEMM_MAX_ROWS, fork._project_residual = max_rows, project_residual


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="cublas", batch=16)


if __name__ == "__main__":
    main()
