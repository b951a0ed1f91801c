"""Issue 29: the TMA few-row GEMM's K splits and rings on each projection it runs in a B=16 replayed step.

Since entry 72 the o projection, the fused gate/up projection (with the SiLU-and-mul in its epilogue), the down
projection and the LM head of a B=16 decode step run on ``kernels/gluon_sm90/rows_gemm.py``, at
``tma_rows_gemm_config``'s split and ring (o, head: one slice, ring 6; gate/up: one slice, ring 2; down: 4 slices,
ring 4). This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no
compile) on ``bench_generate``'s model (bf16, 16 random 512-token prompts), the variants alternating over
``--rounds`` rounds, each replacing the split and ring of one projection (by weight shape and ``swiglu``) while
the session is built and captured.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s.

    python benchmarks/probes/session_tma_configs_b16.py --out session_tma_configs_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import rows_gemm as tma  # noqa: E402

O_PROJ, GATE_UP, DOWN, HEAD = (2048, 2048, False), (16384, 2048, True), (2048, 8192, False), (128256, 2048, False)
VARIANTS = {  # name: ({(N, K, swiglu): (split_k, num_stages)},)
    "shipped": ({},),
    "gate_up_st3": ({GATE_UP: (1, 3)},),
    "gate_up_st1": ({GATE_UP: (1, 1)},),
    "o_st8": ({O_PROJ: (1, 8)},),
    "o_s2_st6": ({O_PROJ: (2, 6)},),
    "o_st4": ({O_PROJ: (1, 4)},),
    "down_s4_st3": ({DOWN: (4, 3)},),
    "down_s8_st4": ({DOWN: (8, 4)},),
    "head_st4": ({HEAD: (1, 4)},),
    "head_st8": ({HEAD: (1, 8)},),
}


def timed_session(model, input_ids, configs: dict) -> dict:
    run = tma.tma_rows_gemm

    def with_config(x, weight, bias, *, swiglu=False, **rest):
        split_k, num_stages = configs.get((*weight.shape, swiglu), (None, None))
        return run(x, weight, bias, swiglu=swiglu, split_k=split_k, num_stages=num_stages, **rest)

    tma.tma_rows_gemm = with_config
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        tma.tma_rows_gemm = run


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
