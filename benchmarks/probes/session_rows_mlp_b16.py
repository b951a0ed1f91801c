"""Issue 29: the MLP of a B=16 replayed step as one launch (``kernels/gluon_sm90/rows_mlp.py``) against the two TMA
few-row GEMM launches before it (gate/up with the SiLU-and-mul, then the down projection in 4 K slices).

The one-launch kernel runs both projections as two phases of one 128-program grid: each program's down-projection
work item starts as soon as the 32 gate/up blocks of its K slice are written, and its first weight tiles are copied
after its gate/up loop, before that wait (``down_prefetch`` of them; 2 by default since 04d6509, all 4 of its ring
before). The other ``one_launch`` variants change the two phases' rings (gate/up 2 and down 4 by default; 227 KB of
shared memory allow more). ``early_down``, the down tiles copied at the kernel's start, was an option at 5eb607d and
d9b5dfa (its rows are in those runs' results). ``post_attention`` runs the o projection, the residual add and the
RMSNorm before the MLP in the same launch (``tma_rows_post_attention``): 32 of the programs first compute the o
projection's blocks and, once all are in, each its slice of the norm. ``sleep_ns``: a program waiting on a count
sleeps that long between two reads of it (none by default).

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts), the variants alternating over ``--rounds`` rounds,
each set while the session is built and captured. Per variant: µs per replayed step and the first step where row
0's 32 tokens part from ``two_launches``'.

    python benchmarks/probes/session_rows_mlp_b16.py --out session_rows_mlp_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore import layer_ops  # noqa: E402
from flashcore.kernels.gluon_sm90 import rows_mlp  # noqa: E402

VARIANTS = {  # name: (the MLP in one launch, the o projection + add-and-norm + MLP in one, {tma_rows_mlp's options})
    "two_launches": (False, False, {}),
    "one_launch": (True, False, {}),
    "one_launch_down_ring6": (True, False, {"down_stages": 6}),
    "one_launch_gate_up_ring3": (True, False, {"gate_up_stages": 3}),
    "one_launch_gate_up_ring3_down_ring5": (True, False, {"gate_up_stages": 3, "down_stages": 5}),
    "one_launch_down_prefetch0": (True, False, {"down_prefetch": 0}),
    "one_launch_down_prefetch1": (True, False, {"down_prefetch": 1}),
    "one_launch_down_prefetch2": (True, False, {"down_prefetch": 2}),
    "one_launch_down_ring6_prefetch2": (True, False, {"down_stages": 6, "down_prefetch": 2}),
    "one_launch_down_prefetch4": (True, False, {"down_prefetch": 4}),
    "post_attention": (True, True, {}),
    "post_attention_o_ring4": (True, True, {"o_stages": 4}),
    "one_launch_sleep100": (True, False, {"sleep_ns": 100}),
    "post_attention_sleep100": (True, True, {"sleep_ns": 100}),
    "post_attention_sleep500": (True, True, {"sleep_ns": 500}),
}


def timed_session(model, input_ids, fuse: bool, post_attention: bool, options: dict) -> dict:
    runs = rows_mlp.tma_rows_mlp, rows_mlp.tma_rows_post_attention
    switches = layer_ops.FUSE_MLP, layer_ops.FUSE_POST_ATTENTION

    def with_options(run):
        return lambda *args, **kwargs: run(*args, **options, **kwargs)

    rows_mlp.tma_rows_mlp, rows_mlp.tma_rows_post_attention = map(with_options, runs)
    layer_ops.FUSE_MLP, layer_ops.FUSE_POST_ATTENTION = fuse, post_attention
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        rows_mlp.tma_rows_mlp, rows_mlp.tma_rows_post_attention = runs
        layer_ops.FUSE_MLP, layer_ops.FUSE_POST_ATTENTION = switches


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="two_launches", batch=16)


if __name__ == "__main__":
    main()
