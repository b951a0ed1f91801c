"""Issue 29: the q/k/v projection, with the input RMSNorm and the RoPE, on the TMA few-row GEMM in a B=16 step.

Until this probe the q/k/v projection of a B=16 decode step ran on the Triton few-row GEMM (the norm in its
prologue, the RoPE in its epilogue; entries 68 and 71) and the TMA kernel (``kernels/gluon_sm90/rows_gemm.py``,
entry 72) took only the plain calls. Now the TMA kernel takes the norm (after the PDL wait each program copies all
of x into shared memory, sums its rows' squares over K and normalizes its slice there, while the first weight tiles
stream) and the RoPE (the two halves of a program's pairs meet through shared memory). This probe times a
``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on ``bench_generate``'s
model (bf16, 16 random 512-token prompts), the variants alternating over ``--rounds`` rounds:

- ``triton_qkv``: the q/k/v projection on the Triton kernel, as before (the TMA kernel's ``supports`` answering
  False for calls with the norm or the RoPE);
- ``shipped``: on the TMA kernel at ``tma_rows_gemm_config``'s split and ring for the norm (2 slices, ring 4);
- ``qkv_s<split>_st<ring>``: other splits and rings;
- ``norm_apart_s<split>_st<ring>``: the norm in a launch of its own (``layer_kernels.rms_norm_triton``, the
  kernel the MLP's norm runs on), then the TMA kernel with the RoPE alone.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``triton_qkv``'s (the sum
of squares in another order: they may part at a near-tie).

    python benchmarks/probes/session_tma_qkv_b16.py --out session_tma_qkv_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import rows_gemm as tma  # noqa: E402
from flashcore.kernels.triton import layer_kernels  # noqa: E402

VARIANTS = {  # name: (q/k/v on the TMA kernel, (split_k, num_stages) or None for the shipped config[, norm apart])
    "triton_qkv": (False, None),
    "shipped": (True, None),
    "qkv_s2_st8": (True, (2, 8)),
    "norm_apart_s1_st6": (True, (1, 6), True),
    "norm_apart_s2_st4": (True, (2, 4), True),
    "norm_apart_s2_st6": (True, (2, 6), True),
    "qkv_s4_st4": (True, (4, 4)),
    "qkv_s2_st6": (True, (2, 6)),
    "qkv_s2_st2": (True, (2, 2)),
    "qkv_s4_st2": (True, (4, 2)),
}


def timed_session(model, input_ids, on_tma: bool, config, norm_apart: bool = False) -> dict:
    supports, run = tma.supports, tma.tma_rows_gemm

    def supports_qkv(x, weight, swiglu=False, **operands):
        folded = operands.get("norm_weight") is not None or operands.get("cos") is not None
        return (on_tma or not folded) and supports(x, weight, swiglu, **operands)

    def with_config(x, weight, bias, *, norm_weight=None, eps=0.0, cos=None, **rest):
        split_k, num_stages = config if config and (norm_weight is not None or cos is not None) else (None, None)
        if norm_apart and norm_weight is not None:
            x, norm_weight = layer_kernels.rms_norm_triton(x, norm_weight, eps), None
        return run(x, weight, bias, norm_weight=norm_weight, eps=eps, cos=cos, split_k=split_k, num_stages=num_stages,
                   **rest)  # fmt: skip

    tma.supports, tma.tma_rows_gemm = supports_qkv, with_config
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        tma.supports, tma.tma_rows_gemm = supports, run


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="triton_qkv", batch=16)


if __name__ == "__main__":
    main()
