"""Issue 29: the q/k/v projection on flashcore's few-row GEMM, with the RMSNorm and the RoPE inside, at B=16.

At 16 rows a decoder layer ran its input RMSNorm (a launch), the q/k/v GEMM on cuBLAS and the RoPE (a launch).
``layer_ops.rows_gemm(x, W, norm_weight=, eps=, cos=, sin=, rotated=)`` runs the three as one launch, as entry 65's
down projection took its SiLU-and-mul and residual add. This probe times a ``DecodeSession``'s replayed step
(``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model (bf16, 16 random 512-token prompts) in one
process, the variants alternating over ``--rounds`` rounds:

- ``cublas_qkv`` / ``cublas_qkv_compiled``: the fold off (the fork's ``_rows_gemm_rotates`` answering False while the
  session is built and captured), as before;
- ``rows_gemm_qkv`` / ``rows_gemm_qkv_compiled``: as shipped (at b793f9d 4 K slices of one 64 x 512 tile, entry 68;
  since entry 71 2 slices of one 64 x 1024 tile); ``_compiled`` with ``compile=True``;
- ``rows_gemm_qkv_k128`` / ``..._k512_w8``: the q/k/v shape's tiles 64 x 128 at 4 warps (before entry 68) or 64 x
  512 at 8 warps, in the shipped config's K slices (``rows_gemm.rows_gemm_config``'s tile width and warps replaced
  for that shape);
- ``rows_gemm_qkv_norm_apart``, ``..._norm_apart_k512``: the RoPE inside, the norm a launch of its own as before (the
  integration's ``runs_kernel_norm`` answering False), with 64 x 128 or 64 x 512 tiles, to part the norm's
  prologue from the rest.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``cublas_qkv``'s (another
summation order, and the norm's squares summed in another order, so they may part at a near-tie).

    python benchmarks/probes/session_qkv_rows_gemm_b16.py --out session_qkv_rows_gemm_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.integrations import llama_forward_fork as fork  # noqa: E402
from flashcore.kernels.triton import rows_gemm as rows_gemm_kernels  # noqa: E402

VARIANTS = {  # name: (the fold, compile, the norm inside, the q/k/v tile's K and warps or None)
    "cublas_qkv": (False, False, True, None),
    "rows_gemm_qkv": (True, False, True, None),
    "cublas_qkv_compiled": (False, True, True, None),
    "rows_gemm_qkv_compiled": (True, True, True, None),
    "rows_gemm_qkv_k128": (True, False, True, (128, 4)),
    "rows_gemm_qkv_k512_w8": (True, False, True, (512, 8)),
    "rows_gemm_qkv_norm_apart": (True, False, False, None),
    "rows_gemm_qkv_norm_apart_k512": (True, False, False, (512, 4)),
}
QKV_SHAPE = (3072, 2048)  # bench_generate's model, fused


def with_qkv_tiles(config, block_k: int, num_warps: int):
    def replaced(n: int, k: int, device, norm: bool = False, element_size: int = 2):
        tiles = config(n, k, device, norm, element_size)
        if (n, k) == QKV_SHAPE:
            tiles = dict(tiles, block_k=block_k, num_warps=num_warps)
        return tiles

    return replaced


def timed_session(model, input_ids, fold: bool, compile: bool, norm_inside: bool, tiles: tuple | None) -> dict:
    rotates, runs_kernel_norm = fork._rows_gemm_rotates, fork.layer_kernels.runs_kernel_norm
    config = rows_gemm_kernels.rows_gemm_config
    if not fold:
        fork._rows_gemm_rotates = lambda *args: False
    if not norm_inside:  # at 16 rows only the few-row GEMM asks
        fork.layer_kernels.runs_kernel_norm = lambda norm: False
    if tiles is not None:
        rows_gemm_kernels.rows_gemm_config = with_qkv_tiles(config, *tiles)
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True, compile=compile)
    finally:
        fork._rows_gemm_rotates, fork.layer_kernels.runs_kernel_norm = rotates, runs_kernel_norm
        rows_gemm_kernels.rows_gemm_config = config


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="cublas_qkv", batch=16)


if __name__ == "__main__":
    main()
