"""Issue 29: the MLP of a B=16 replayed step as one launch (``kernels/gluon_sm90/rows_mlp.py``) against the two TMA
few-row GEMM launches that ship (gate/up with the SiLU-and-mul, then the down projection in 4 K slices).

The one-launch kernel runs both projections as two phases of one 128-program grid: each program's down-projection
work item starts as soon as the 32 gate/up blocks of its K slice are written, and its first weight tiles are copied
while the gate/up phase runs (after that phase's loop, or at the kernel's start with ``early_down``); the other
variants change the two phases' rings (2 and 4 shipped; shared memory allows 227 KB, 155 KB at 2 and 4) and how
many of the down projection's first tiles are copied before its wait (``down_prefetch``, all of its ring shipped).
This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts), the variants alternating over ``--rounds`` rounds,
each set while the session is built and captured.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``two_launches``'.

    python benchmarks/probes/session_rows_mlp_b16.py --out session_rows_mlp_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore import layer_ops  # noqa: E402
from flashcore.kernels.gluon_sm90 import rows_mlp  # noqa: E402

VARIANTS = {  # name: (one launch, {tma_rows_mlp's options})
    "two_launches": (False, {}),
    "one_launch": (True, {}),
    "one_launch_early_down": (True, {"early_down": True}),
    "one_launch_down_ring6": (True, {"down_stages": 6}),
    "one_launch_gate_up_ring3": (True, {"gate_up_stages": 3}),
    "one_launch_gate_up_ring3_down_ring5": (True, {"gate_up_stages": 3, "down_stages": 5}),
    "one_launch_down_prefetch0": (True, {"down_prefetch": 0}),
    "one_launch_down_prefetch1": (True, {"down_prefetch": 1}),
    "one_launch_down_prefetch2": (True, {"down_prefetch": 2}),
    "one_launch_down_ring6_prefetch2": (True, {"down_stages": 6, "down_prefetch": 2}),
}


def timed_session(model, input_ids, fuse: bool, options: dict) -> dict:
    run, fused_before = rows_mlp.tma_rows_mlp, layer_ops.FUSE_MLP

    def with_option(*args, **kwargs):
        return run(*args, **options, **kwargs)

    rows_mlp.tma_rows_mlp, layer_ops.FUSE_MLP = with_option, fuse
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        rows_mlp.tma_rows_mlp, layer_ops.FUSE_MLP = run, fused_before


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="two_launches", batch=16)


if __name__ == "__main__":
    main()
