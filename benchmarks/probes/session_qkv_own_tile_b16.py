"""Issue 29: the q/k/v projection's norm without reading its own slice twice, in a B=16 replayed step.

``probes/session_qkv_bounds_b16.py`` (entry 89) found that taking the norm's sums of squares out of the q/k/v
projection shortens a B=16 step by 31.8 µs. After its PDL wait each of its 96 programs (2 K slices of one 64 x 1024
tile) loads its 16 rows' two 1024-wide halves for the sums, adds the halves' squares and reduces them, then loads
its own half again to normalize it before its MMA: an L2 round trip after the reduction, every layer. Here
(``rows_gemm_config``'s ``own_tile_norm``) a program loads its own half and the other at once, reduces each half's
squares, adds the two sums (fp32 addition commutes: both programs of a row block get the same bits), and normalizes
its own half from registers. The sums are added in another order than shipped's, so a norm may round the other
way.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts) in one process, the variants alternating over
``--rounds`` rounds, each replacing ``rows_gemm.rows_gemm_config`` for the q/k/v shape while the session is built
and captured:

- ``shipped``;
- ``own_tile``.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s.

It runs at dfce868 only: ``own_tile_norm`` was taken out of the kernel after it (level; entry 89).

    python benchmarks/probes/session_qkv_own_tile_b16.py --out session_qkv_own_tile_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

VARIANTS = {"shipped": (None,), "own_tile": (dict(own_tile_norm=True),)}  # name: (the q/k/v config's overrides,)


def main() -> None:
    harness.qkv_config_probe_main(__doc__, VARIANTS)


if __name__ == "__main__":
    main()
