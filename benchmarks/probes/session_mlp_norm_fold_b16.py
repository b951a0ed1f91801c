"""Issue 29: the MLP's RMSNorm inside the TMA few-row GEMM of the gate/up projection, in a B=16 replayed step.

Entry 72 put a B=16 step's o, gate/up and down projections on the TMA few-row GEMM; between the o and gate/up
projections the add-and-norm kernel still ran (the residual add after attention and the MLP's norm, one launch).
Since entry 74 the o projection's epilogue adds the residual and the gate/up GEMM normalizes its input tiles itself
(``rows_gemm(..., norm_weight=, swiglu=True)``): one launch a layer fewer, the norm's squares summed by every
program of the gate/up GEMM after its wait. This probe times a ``DecodeSession``'s replayed step
(``fuse_projections`` and ``layer_kernels``, no compile) on ``bench_generate``'s model (bf16, 16 random 512-token
prompts), the variants alternating over ``--rounds`` rounds:

- ``norm_in_gate_up``: shipped;
- ``add_norm_kernel``: the fork's ``_streams_attention_output_and_mlp`` answering False, so the decoder layer runs
  the add-and-norm kernel between the o and gate/up projections (entry 72's step).

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``norm_in_gate_up``'s (the
norm's squares are summed in another order: they may part at a near-tie).

    python benchmarks/probes/session_mlp_norm_fold_b16.py --out session_mlp_norm_fold_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.integrations import llama_forward_fork as fork  # noqa: E402

VARIANTS = {"norm_in_gate_up": (True,), "add_norm_kernel": (False,)}


def timed_session(model, input_ids, fold: bool) -> dict:
    shipped = fork._streams_attention_output_and_mlp
    if not fold:
        fork._streams_attention_output_and_mlp = lambda layer, x: False
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        fork._streams_attention_output_and_mlp = shipped


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="norm_in_gate_up", batch=16)


if __name__ == "__main__":
    main()
