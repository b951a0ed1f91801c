"""Issue 29: the q/k/v projection's loads after its PDL wait, in a B=16 replayed step.

After its wait a program of the q/k/v projection (3072 x 2048, 2 K slices of one 64 x 1024 tile, the norm and the
RoPE inside; entry 71) reads its 16 rows for the norm's sums in a loop of two 16 x 1024 loads, the second issued
after the first one's squares, then its own slice again; and the last program of each row block loads the rows' cos
and sin only after the split-K sum. Each is a round trip through L2 on the step's critical path, every layer. This
probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts) in one process, the variants alternating over
``--rounds`` rounds, each replacing ``rows_gemm.rows_gemm_config`` for the q/k/v shape while the session is built
and captured:

- ``shipped``;
- ``early_rotary``: every program loads its rows' cos and sin right after the wait;
- ``unrolled_norm``: the norm's loads unrolled, so both are in flight at once (the same sums);
- ``both``.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s (the
variants compute the same bits: they should not part).

It runs at ddd5d89 only: ``rows_gemm_config``'s ``early_rotary`` and ``unrolled_norm``, which the variants set, were
taken out of the kernel after this probe (entry 88).

    python benchmarks/probes/session_qkv_loads_b16.py --out session_qkv_loads_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

VARIANTS = {  # name: (the q/k/v shape's config overrides,) or (None,)
    "shipped": (None,),
    "early_rotary": (dict(early_rotary=True),),
    "unrolled_norm": (dict(unrolled_norm=True),),
    "both": (dict(early_rotary=True, unrolled_norm=True),),
}


def main() -> None:
    harness.qkv_config_probe_main(__doc__, VARIANTS)


if __name__ == "__main__":
    main()
