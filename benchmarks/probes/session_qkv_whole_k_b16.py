"""Issue 29: the q/k/v projection over all of K in each program, no split-K sum, in a B=16 replayed step.

The few-row GEMM runs ``bench_generate``'s q/k/v projection (3072 x 2048, the norm and the RoPE inside) in 2 K
slices of one 64 x 1024 tile (96 programs, entry 71). Each row block's two programs store fp32 partials, and the last
to take the block's ticket loads them back, adds them, rotates and stores: three round trips through L2 after the
last product, on the step's critical path every layer. With 32 weight rows a program each program can hold its
rows' whole K (two 32 x 1024 tiles, both loaded before the PDL wait): the same 96 programs and 128 KB a program,
no partials and no ticket. This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and
``layer_kernels``, no compile) on ``bench_generate``'s model (bf16, 16 random 512-token prompts) in one process,
the variants alternating over ``--rounds`` rounds, each replacing ``rows_gemm.rows_gemm_config`` for the q/k/v
shape while the session is built and captured:

- ``shipped``: 2 slices of one 64 x 1024 tile at 8 warps (96 programs);
- ``qkv_n32_preload2_w8``: 32 weight rows a program, all of K as two 32 x 1024 tiles loaded before the wait, 8 warps
  (96 programs, no split);
- ``qkv_n32_k2048_w8``: the same as one 32 x 2048 tile;
- ``qkv_n32_split2_w4``: 32 weight rows, 2 slices of one 32 x 1024 tile at 4 warps (192 programs, split-K sum).

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s (another
summation order: they may part at a near-tie).

It runs at 7d8f31a only: ``rows_gemm_config``'s ``preload``, which the variants set, was taken out of the kernel
after this probe (entry 88).

    python benchmarks/probes/session_qkv_whole_k_b16.py --out session_qkv_whole_k_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

VARIANTS = {  # name: (the q/k/v shape's config overrides,) or (None,)
    "shipped": (None,),
    "qkv_n32_preload2_w8": (dict(block_n=32, block_k=1024, split_k=1, preload=2, num_warps=8),),
    "qkv_n32_k2048_w8": (dict(block_n=32, block_k=2048, split_k=1, preload=1, num_warps=8),),
    "qkv_n32_split2_w4": (dict(block_n=32, block_k=1024, split_k=2, preload=1, num_warps=4),),
}


def main() -> None:
    harness.qkv_config_probe_main(__doc__, VARIANTS)


if __name__ == "__main__":
    main()
