"""Issue 29: the few-row GEMM on TMA copies (``kernels/gluon_sm90/rows_gemm.py``) in a B=16 replayed step.

``probes/tma_rows_gemm_alone.py`` timed the Gluon kernel alone against cuBLAS and the Triton few-row GEMM. This
probe puts it in the step: a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no
compile) on ``bench_generate``'s model (bf16, 16 random 512-token prompts), the variants alternating over
``--rounds`` rounds. ``rows_gemm.rows_gemm_triton`` is replaced for the session's build and capture so that its
calls without the SiLU-and-mul, the norm or the RoPE on the named shapes run the Gluon kernel at the given K split
and ring depth:

- ``shipped``;
- ``head_s1_st6``: the LM head (128256 x 2048), one K slice, a ring of 6 tiles;
- ``o_s1_st6``, ``o_s4_st4``: the o projection, with the residual add, on the few-row GEMM (as in
  ``session_rows_gemm_b16``) and there on the Gluon kernel;
- ``gate_up_s1_st2``, ``gate_up_s1_st4``: the fused gate/up projection on the few-row GEMM (as in
  ``session_wide_tiles_b16``) and there on the Gluon kernel;
- ``all_s1``: the three, each at its first variant's ring;
- ``swiglu_*``: the fused gate/up projection on the Gluon kernel with the SiLU-and-mul in its epilogue (each
  program the gate's and the up's rows of the same outputs), so that the down projection is a plain GEMM with the
  residual: on the Triton few-row GEMM (``_down_triton``) or the Gluon kernel at the named split and ring;
- ``o_swiglu_down``: the o projection too.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s (other
summation orders: they may part at a near-tie).

    python benchmarks/probes/session_tma_rows_gemm_b16.py --out session_tma_rows_gemm_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from session_wide_tiles_b16 import with_gate_up  # noqa: E402

from flashcore import layer_ops  # noqa: E402
from flashcore.integrations import llama_forward_fork as fork  # noqa: E402
from flashcore.kernels.gluon_sm90 import rows_gemm as tma  # noqa: E402
from flashcore.kernels.triton import rows_gemm as rows_gemm_kernels  # noqa: E402

HEAD, O_PROJ, GATE_UP, DOWN = (128256, 2048), (2048, 2048), (16384, 2048), (2048, 8192)  # bench_generate's model
SWIGLU = "swiglu"  # gate/up on the Gluon kernel with the SiLU-and-mul in its epilogue, at this (split_k, num_stages)
VARIANTS = {  # name: ({shape or SWIGLU: (split_k, num_stages)},)
    "shipped": ({},),
    "head_s1_st6": ({HEAD: (1, 6)},),
    "o_s1_st6": ({O_PROJ: (1, 6)},),
    "o_s4_st4": ({O_PROJ: (4, 4)},),
    "gate_up_s1_st2": ({GATE_UP: (1, 2)},),
    "gate_up_s1_st4": ({GATE_UP: (1, 4)},),
    "all_s1": ({HEAD: (1, 6), O_PROJ: (1, 6), GATE_UP: (1, 2)},),
    "swiglu_s1_st2_down_triton": ({SWIGLU: (1, 2)},),
    "swiglu_s1_st2_down_s2_st6": ({SWIGLU: (1, 2), DOWN: (2, 6)},),
    "swiglu_s1_st2_down_s4_st4": ({SWIGLU: (1, 2), DOWN: (4, 4)},),
    "swiglu_s1_st2_down_s4_st6": ({SWIGLU: (1, 2), DOWN: (4, 6)},),
    "swiglu_s2_st2_down_s4_st4": ({SWIGLU: (2, 2), DOWN: (4, 4)},),
    "o_swiglu_down": ({O_PROJ: (1, 6), SWIGLU: (1, 2), DOWN: (4, 4)},),
}


def with_tma(rows_gemm_triton, configs: dict):
    """``rows_gemm_triton``, with its plain calls (a residual at most) on ``configs``' shapes on the Gluon kernel."""

    def wrapped(x, weight, bias, *, up=None, norm_weight=None, cos=None, residual=None, out=None, **rest):
        config = configs.get(tuple(weight.shape))
        if config is not None and up is None and norm_weight is None and cos is None and tma.supports(x, weight):
            split_k, num_stages = config
            return tma.tma_rows_gemm(
                x, weight, bias, residual=residual, out=out, split_k=split_k, num_stages=num_stages
            )
        return rows_gemm_triton(
            x, weight, bias, up=up, norm_weight=norm_weight, cos=cos, residual=residual, out=out, **rest
        )

    return wrapped


def with_swiglu(project, split_k: int, num_stages: int):
    """The fork's ``_project``, with the fused gate/up projection and the SiLU-and-mul after it in one launch of the
    Gluon kernel at 2 to 16 rows: it returns ``((silu_and_mul(gate, up), None), False)``."""

    def wrapped(module, x, names, norm=None, rotary=None):
        fused = module.__dict__.get("_fused_projection")
        if names == ("gate_proj", "up_proj") and fused is not None and norm is None and fork._runs_rows_gemm(module, x):
            x_rows = x.reshape(-1, x.shape[-1])
            act = tma.tma_rows_gemm(
                x_rows, fused.weight, fused.bias, swiglu=True, split_k=split_k, num_stages=num_stages
            )
            return (act.view(*x.shape[:-1], -1), None), False
        return project(module, x, names, norm=norm, rotary=rotary)

    return wrapped


def with_plain_projection(project_residual, names: tuple[str, ...]):
    """The fork's ``_project_residual``, with ``names``' projections (no ``up``) on the few-row GEMM with the
    residual inside."""

    def wrapped(module, x, name, residual, up=None):
        linear = getattr(module, name)
        if name in names and up is None and fork._runs_rows_gemm(module, x) and fork._is_plain_linear(linear):
            return layer_ops.rows_gemm(x, linear.weight, linear.bias, residual=residual)
        return project_residual(module, x, name, residual, up=up)

    return wrapped


def timed_session(model, input_ids, configs: dict) -> dict:
    rows_gemm_triton, project, project_residual = (
        rows_gemm_kernels.rows_gemm_triton,
        fork._project,
        fork._project_residual,
    )
    rows_gemm_kernels.rows_gemm_triton = with_tma(rows_gemm_triton, configs)
    plain = (("o_proj",) if O_PROJ in configs else ()) + (("down_proj",) if SWIGLU in configs else ())
    fork._project_residual = with_plain_projection(project_residual, plain)
    if GATE_UP in configs:
        fork._project = with_gate_up(project)
    if SWIGLU in configs:
        fork._project = with_swiglu(project, *configs[SWIGLU])
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        rows_gemm_kernels.rows_gemm_triton, fork._project, fork._project_residual = (
            rows_gemm_triton,
            project,
            project_residual,
        )


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
