"""Issue 29: bounds: the B=16 replayed step with parts of the q/k/v projection taken out.

The q/k/v projection (3072 x 2048, 12.6 MB, the norm and the RoPE inside; 2 K slices of one 64 x 1024 tile a
program, 96 programs) advances a B=16 layer by 10.0 µs where its weight needs 4.2 at the copy (entry 86). A
program loads its tile before its PDL wait, but can start only once an SM is free of the MLP before it. How much of
the 10 µs is that weight stream, and how much the chain after the wait (the norm's reads, the MMA, the split-K
ticket, the RoPE)? This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and
``layer_kernels``, no compile) on ``bench_generate``'s model (bf16, 16 random 512-token prompts) in one process, the
variants alternating over ``--rounds`` rounds:

- ``shipped``;
- ``weightless``: the q/k/v programs load no weight (masked loads: zeros), everything else as shipped. The tokens
  are wrong (every q, k and v is zero); the timing is the bound of any change that hides the q/k/v weight stream,
  such as a persistent kernel that loads it during the MLP;
- ``no_ticket``: no split-K sum: each of a row block's two programs writes its own slice's products as the output
  (racing; wrong values), with no partial stored, no ticket and no reload: the bound of a cheaper split-K handoff;
- ``no_norm_sums``: the norm's sums of squares not taken (each row scaled by 1; wrong values): the bound of the
  norm's prologue, the first reads of x after the wait.

Per variant: µs per replayed step (the tokens of the bounds part from ``shipped``'s, as they must).

It runs at ce2c370 only (04bfb80, where it was named ``session_qkv_weightless_b16.py``: the first two variants):
``rows_gemm_config``'s ``weightless``, ``no_ticket`` and ``no_norm_sums`` were taken out of the kernel after it
(entry 89).

    python benchmarks/probes/session_qkv_bounds_b16.py --out session_qkv_bounds_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

VARIANTS = {  # name: (the q/k/v config's overrides,)
    "shipped": (None,),
    "weightless": (dict(weightless=True),),
    "no_ticket": (dict(no_ticket=True),),
    "no_norm_sums": (dict(no_norm_sums=True),),
}


def main() -> None:
    harness.qkv_config_probe_main(__doc__, VARIANTS)


if __name__ == "__main__":
    main()
