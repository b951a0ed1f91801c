"""Issue 29: the few-row GEMM's 512-wide K tiles on the other projections of a B=16 replayed step.

Entry 68 found that on the q/k/v projection with the norm inside, a tile that holds most or all of a program's K
slice, loaded before the PDL wait, made the few-row GEMM 16-19 µs a step faster than cuBLAS where 64 x 128 tiles
were 44-47 µs slower. ``rows_gemm_config(..., norm=True)`` takes those tiles; the other shapes keep 64 x 128. This
probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts) in one process, the variants alternating over
``--rounds`` rounds:

- ``shipped``;
- ``wide_down_head``: the down projection and the LM head on the wide tiles too (``rows_gemm.rows_gemm_config``
  replaced so that every shape takes the tiles ``norm=True`` gives);
- ``o_rows_gemm``, ``o_rows_gemm_wide``: the o projection on the few-row GEMM (``session_rows_gemm_b16``'s wrapper
  of the fork's ``_project_residual``), with 64 x 128 or wide tiles;
- ``gate_up_rows_gemm_wide``: the fused gate/up projection on the few-row GEMM with wide tiles (the fork's
  ``_project`` wrapped for those two names at 2 to 16 rows);
- ``all_wide``: every projection on the few-row GEMM with wide tiles;
- ``gate_up_rows_gemm``, ``gate_up_rows_gemm_wide_only``: gate/up on the few-row GEMM with 64 x 128 tiles, or with
  wide tiles on its shape alone (16384 x 2048, ``GATE_UP_SHAPE``).

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s (other
summation orders: they may part at a near-tie).

    python benchmarks/probes/session_wide_tiles_b16.py --out session_wide_tiles_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from session_rows_gemm_b16 import with_o_projection  # noqa: E402

from flashcore import layer_ops  # noqa: E402
from flashcore.integrations import llama_forward_fork as fork  # noqa: E402
from flashcore.kernels.triton import rows_gemm as rows_gemm_kernels  # noqa: E402

VARIANTS = {  # name: (wide tiles: everywhere, on the gate/up shape or nowhere; o on the few-row GEMM; gate/up on it)
    "shipped": (False, False, False),
    "wide_down_head": (True, False, False),
    "o_rows_gemm": (False, True, False),
    "o_rows_gemm_wide": (True, True, False),
    "gate_up_rows_gemm_wide": (True, False, True),
    "all_wide": (True, True, True),
    "gate_up_rows_gemm": (False, False, True),
    "gate_up_rows_gemm_wide_only": ("gate_up", False, True),
}
GATE_UP_SHAPE = (16384, 2048)  # bench_generate's model, fused


def with_gate_up(project):
    """The fork's ``_project``, with the fused gate/up projection on the few-row GEMM at 2 to 16 rows."""

    def wrapped(module, x, names, norm=None, rotary=None):
        fused = module.__dict__.get("_fused_projection")
        if names == ("gate_proj", "up_proj") and fused is not None and norm is None and fork._runs_rows_gemm(module, x):
            return layer_ops.rows_gemm(x, fused.weight, fused.bias).split(fused.out_features, dim=-1), False
        return project(module, x, names, norm=norm, rotary=rotary)

    return wrapped


def timed_session(model, input_ids, wide: bool | str, o_too: bool, gate_up_too: bool) -> dict:
    config, project, project_residual = rows_gemm_kernels.rows_gemm_config, fork._project, fork._project_residual
    if wide:
        rows_gemm_kernels.rows_gemm_config = lambda n, k, device, norm=False: config(
            n, k, device, norm or wide is True or (n, k) == GATE_UP_SHAPE
        )
    if o_too:
        fork._project_residual = with_o_projection(project_residual)
    if gate_up_too:
        fork._project = with_gate_up(project)
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        rows_gemm_kernels.rows_gemm_config, fork._project, fork._project_residual = config, project, project_residual


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
