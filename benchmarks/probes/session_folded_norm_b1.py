"""Issue 29: what computing each layer's RMSNorms inside the q/k/v and gate/up GEMVs saves in a B=1 replayed step.

With ``layer_kernels=True`` a one-token step runs every projection on flashcore's GEMV
(``flashcore/kernels/triton/gemv.py``). Since entry 55 the GEMV also takes the layer's two RMSNorms: each program
sums the squares of the input row itself, then normalizes it as it reads it, and the norm kernel is gone. This probe
times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model
(the Llama-3.2-1B shape, bf16, a 512-token prompt, ``max_cache_len=2048``) in one process, the variants alternating
over ``--rounds`` rounds:

- ``norm_kernel``: the norms on their own kernel (the fold switched off by making
  ``flashcore.integrations.layer_kernels.runs_kernel_norm`` answer False in this process);
- ``folded_two_steps``: folded, with the GEMV's tiles for K 2048 without the norm (K in two steps of 1024 at 4 warps:
  the row is read twice, once for the sum of squares and once for the products);
- ``folded_whole_row``: folded, with one K step of 2048 at 8 warps (``harness.gemv_whole_row_config``; the
  default until entry 57);
- ``norm_kernel_compiled`` / ``folded_whole_row_compiled``: the first and the last with ``compile=True``.

Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays; the context grows
by 500 tokens over them), and the first step where its 32 greedy tokens part from ``norm_kernel``'s (the folded norm
sums its squares in another order, so an input may round the other way; None: all equal).

    python benchmarks/probes/session_folded_norm_b1.py --out benchmarks/probes/results/session_folded_norm_b1.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.integrations import layer_kernels  # noqa: E402
from flashcore.kernels.triton import gemv as gemv_kernels  # noqa: E402

VARIANTS = {  # name: (compile, fold the norm, the folded GEMVs on the whole-row tiles)
    "norm_kernel": (False, False, True),
    "folded_two_steps": (False, True, False),
    "folded_whole_row": (False, True, True),
    "norm_kernel_compiled": (True, False, True),
    "folded_whole_row_compiled": (True, True, True),
}


def timed_session(model, input_ids, compile: bool, fold: bool, whole_row: bool) -> dict:
    runs_kernel_norm, gemv_config = layer_kernels.runs_kernel_norm, gemv_kernels.gemv_config
    if not fold:
        layer_kernels.runs_kernel_norm = lambda norm: False
    # The folded GEMVs (q/k/v and gate/up: n != k, n <= 16 * k, K <= 4096; not o, down or the LM head) on the
    # variant's tiles. Since entry 57 gemv_config gives the two-step tiles, so the whole-row ones are set here.
    folded_whole_row = whole_row and fold

    def probed_config(n: int, k: int) -> dict:
        if folded_whole_row and n != k and n <= 16 * k and k <= 4096:
            return harness.gemv_whole_row_config(k)
        return gemv_config(n, k)

    gemv_kernels.gemv_config = probed_config
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        layer_kernels.runs_kernel_norm, gemv_kernels.gemv_config = runs_kernel_norm, gemv_config


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="norm_kernel")


if __name__ == "__main__":
    main()
