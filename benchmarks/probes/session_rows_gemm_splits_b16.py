"""Issue 29: the few-row GEMM's K slices and tiles on the q/k/v and down projections, in a B=16 replayed step.

``rows_gemm_config`` cuts K into the fewest slices that give every SM a program: on ``bench_generate``'s model that
was 4 slices of the q/k/v weight (192 programs, each one 64 x 512 tile with the norm inside, entry 68) and is 8 of
the down projection's (256 programs of eight 64 x 128 tiles). Both are more programs than the H100's 132 SMs. This
probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts) in one process, the variants alternating over
``--rounds`` rounds, each replacing ``rows_gemm.rows_gemm_config`` for one shape while the session is built and
captured:

- ``shipped`` (since entry 71 q/k/v in 2 slices, one 64 x 1024 tile each at 8 warps: 96 programs);
- ``qkv_split4_k512``: q/k/v as entry 68 shipped it, in 4 slices of one 64 x 512 tile at 4 warps (192 programs);
- ``qkv_split2_k1024_w8``: 2 slices, one 64 x 1024 tile each at 8 warps (what entry 71 ships);
- ``qkv_split8_k256``: q/k/v in 8 slices of one 64 x 256 tile (384 programs);
- ``down_split4``, ``down_split4_k512``: the down projection in 4 slices (128 programs) of 64 x 128 or 64 x 512
  tiles.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s (another
summation order: they may part at a near-tie).

    python benchmarks/probes/session_rows_gemm_splits_b16.py --out session_rows_gemm_splits_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

QKV, DOWN = (3072, 2048), (2048, 8192)  # bench_generate's model, fused q/k/v
VARIANTS = {  # name: (shape, its split_k, block_k and num_warps) or None
    "shipped": (None,),
    "qkv_split4_k512": ((QKV, dict(split_k=4, block_k=512, num_warps=4)),),
    "qkv_split2_k1024_w8": ((QKV, dict(split_k=2, block_k=1024, num_warps=8)),),
    "qkv_split8_k256": ((QKV, dict(split_k=8, block_k=256, num_warps=4)),),
    "down_split4": ((DOWN, dict(split_k=4, block_k=128, num_warps=4)),),
    "down_split4_k512": ((DOWN, dict(split_k=4, block_k=512, num_warps=4)),),
}


def timed_session(model, input_ids, replaced: tuple | None) -> dict:
    shape, tiles = replaced if replaced is not None else (None, {})
    with harness.rows_gemm_config_replaced(shape, tiles):
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
