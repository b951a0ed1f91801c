"""Issue 29: the gate/up projection on the few-row GEMM with the MLP's RMSNorm inside, at B=16 (a proxy).

At 16 rows a decoder layer runs the add after attention with the MLP's RMSNorm as one kernel (entry 63), then the
fused gate/up GEMM on cuBLAS. Entry 68 found the few-row GEMM, with the norm inside and tiles of its whole K slice,
faster than cuBLAS on the q/k/v projection. Before folding the add into such a GEMM too, this probe asks whether
the GEMM with the norm inside beats cuBLAS on gate/up at the same launch count: the add alone (PyTorch's) in place
of the add-and-norm kernel, then the few-row GEMM with ``norm_weight`` (wide tiles, ``norm=True``). It times a
``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on ``bench_generate``'s
model (bf16, 16 random 512-token prompts) in one process, the variants alternating over ``--rounds`` rounds:

- ``shipped``;
- ``gate_up_norm``: as above (``layer_ops.add_rms_norm`` and the fork's ``_project`` wrapped while the session is
  built and captured; each MLP is given its layer's norm).

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s.

    python benchmarks/probes/session_gate_up_norm_b16.py --out session_gate_up_norm_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore import layer_ops  # noqa: E402
from flashcore.integrations import llama_forward_fork as fork  # noqa: E402

VARIANTS = {"shipped": (False,), "gate_up_norm": (True,)}  # name: (gate/up with the norm inside)


def with_gate_up_norm(project):
    def wrapped(module, x, names, norm=None, rotary=None):
        fused, mlp_norm = module.__dict__.get("_fused_projection"), module.__dict__.get("_probe_norm")
        if names == ("gate_proj", "up_proj") and mlp_norm is not None and fork._runs_rows_gemm(module, x):
            eps = mlp_norm.variance_epsilon
            out = layer_ops.rows_gemm(x, fused.weight, fused.bias, norm_weight=mlp_norm.weight, eps=eps)
            return out.split(fused.out_features, dim=-1), False
        if names == ("gate_proj", "up_proj") and mlp_norm is not None:  # more rows: the norm as a launch
            norm = mlp_norm
        return project(module, x, names, norm=norm, rotary=rotary)

    return wrapped


def timed_session(model, input_ids, fold: bool) -> dict:
    project, add_rms_norm = fork._project, layer_ops.add_rms_norm
    if fold:
        for layer in model.model.layers:
            layer.mlp.__dict__["_probe_norm"] = layer.post_attention_layernorm
        fork._project = with_gate_up_norm(project)
        layer_ops.add_rms_norm = lambda x, residual, weight, eps: (residual + x,) * 2  # the sum, as the MLP's input
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        fork._project, layer_ops.add_rms_norm = project, add_rms_norm
        for layer in model.model.layers:
            layer.mlp.__dict__.pop("_probe_norm", None)


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
