"""Issue 29: the GEMVs around the attention call in a B=1 replayed step: their tiles, and when the o GEMV launches.

The o projection (``[2048, 2048]`` on the Llama-3.2-1B shape, with the residual add) runs on ``gemv_config``'s tiles
for K 2048 without the norm: 8 rows a program, K in two steps of 1024 at 4 warps, so each program loads half of its
weight before its PDL wait and the other half after it. With one K step of 2048 at 8 warps (the tiles of the GEMVs
that take the norm, ``whole_row``) a program loads all of its weight before the wait, and at 128 registers a thread
two programs fit an SM, so all 256 programs are resident from the start: the whole weight (8 MB) could be in flight
while the attention's merge still runs. This probe times a ``DecodeSession``'s replayed step (``fuse_projections``
and ``layer_kernels``) on ``bench_generate``'s model (bf16, a 512-token prompt, ``max_cache_len=2048``) in one
process, the variants alternating over ``--rounds`` rounds:

- ``default``: the o GEMV on ``gemv_config``'s tiles;
- ``o_whole_row``: every GEMV with ``n == k`` and no norm (only the o projection on this shape) on
  ``gemv_config(whole_row=True)``'s tiles: 8 x 2048 at 8 warps, at most 128 registers a thread;
- ``o_whole_row_4``: the same with 4 rows a program at 4 warps (512 programs, four an SM);
- ``o_whole_row_merge_early``: ``o_whole_row``, and the split merge releasing the next launch before its wait
  (``split_merge.RELEASE_BEFORE_WAIT``), so that the o GEMV launches while the decode kernel runs and loads its
  weight then (entry 56 measured this release with the two-step tiles: slower);
- ``qkv_two_steps``: the q/k/v GEMV (``whole_row`` and ``n <= 2 * k``: 3072 x 2048 here) on the tiles for K 2048
  without the norm: K in two steps of 1024 at 4 warps, so that its 384 programs fit the SMs in one wave (at 8 warps
  and 128 registers, two programs an SM, they take 1.45 waves), the row read twice;
- ``qkv_whole_row_80``: the q/k/v GEMV on its whole-row tiles at 80 registers a thread, three programs an SM: one
  wave, the row read once (the accumulators and the weight tile may then spill);
- ``gate_up_two_steps``: the same for the gate/up GEMV (``whole_row`` and ``n > 2 * k``; 2048 programs, 7.8 waves
  at two an SM, 3.9 at four);
- ``norm_two_steps``: both;
- ``..._compiled``: with ``compile=True``.

Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays; the context grows
by 500 tokens over them), and the first step where its 32 greedy tokens part from ``default``'s (None: all equal).

    python benchmarks/probes/session_o_whole_row_b1.py --out benchmarks/probes/results/session_o_whole_row_b1.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import gemv as gemv_kernels  # noqa: E402
from flashcore.kernels.triton import split_merge  # noqa: E402

VARIANTS = {  # name: (compile, rows a program of the o GEMV on one K step or 0, merge releases early,
    # the GEMVs with the norm on two K steps, or qkv_80)
    "default": (False, 0, False, ""),
    "o_whole_row": (False, 8, False, ""),
    "o_whole_row_4": (False, 4, False, ""),
    "o_whole_row_merge_early": (False, 8, True, ""),
    "qkv_two_steps": (False, 0, False, "qkv"),
    "qkv_whole_row_80": (False, 0, False, "qkv_80"),
    "gate_up_two_steps": (False, 0, False, "gate_up"),
    "norm_two_steps": (False, 0, False, "qkv,gate_up"),
}
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}


def timed_session(model, input_ids, compile: bool, o_rows: int, merge_early: bool, two_steps: str) -> dict:
    gemv_config = gemv_kernels.gemv_config

    def probed_config(n: int, k: int, whole_row: bool = False) -> dict:
        if whole_row and ("qkv" if n <= 2 * k else "gate_up") in two_steps.split(","):
            return gemv_config(n, k)
        if whole_row and n <= 2 * k and two_steps == "qkv_80":
            return dict(gemv_config(n, k, whole_row), maxnreg=80)
        if whole_row or n != k or not o_rows:
            return gemv_config(n, k, whole_row)
        config = gemv_config(n, k, whole_row=True)
        if o_rows == 4:
            config = dict(config, block_n=4, num_warps=4, maxnreg=None)
        return config

    gemv_kernels.gemv_config = probed_config
    split_merge.RELEASE_BEFORE_WAIT = merge_early
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        gemv_kernels.gemv_config = gemv_config
        split_merge.RELEASE_BEFORE_WAIT = False


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="default")


if __name__ == "__main__":
    main()
