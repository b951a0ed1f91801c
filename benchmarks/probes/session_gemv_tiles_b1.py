"""Issue 29: the GEMVs' tiles in a B=1 replayed step, per projection.

A GEMV program owns ``block_n`` rows and walks K in ``block_k`` steps (``flashcore/kernels/triton/gemv.py``).
``gemv_config``'s tiles for K 2048 take two K steps of 1024 at 4 warps; the whole-row tiles
(``harness.gemv_whole_row_config``) one step of 2048 at 8 warps and at most 128 registers a thread, two programs an SM,
so that a program loads all of its weight before its PDL wait. Until entry 57 the GEMVs that compute the RMSNorm (q/k/v
and gate/up) took the whole-row tiles, which read the input row once for both the norm's sum and the products; since
then every GEMV takes the two-step tiles. This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and
``layer_kernels``) on ``bench_generate``'s model (the Llama-3.2-1B shape, bf16, a 512-token prompt,
``max_cache_len=2048``) in one process, each variant giving some projections other tiles, the variants alternating over
``--rounds`` rounds:

- ``default``: ``gemv_config``'s tiles everywhere;
- ``norm_whole_row``: the q/k/v and gate/up GEMVs on the whole-row tiles (the default before entry 57);
- ``qkv_whole_row`` / ``gate_up_whole_row``: one of them (q/k/v: 3072 x 2048 here, 384 programs, one wave at four an
  SM and 1.45 waves at two; gate/up: 16384 x 2048, 2048 programs);
- ``qkv_whole_row_80``: q/k/v on the whole-row tiles at 80 registers a thread, three programs an SM: one wave, the
  row read once (the accumulators and the weight tile may then spill);
- ``o_whole_row``: the o projection (2048 x 2048, with the residual add) on the whole-row tiles, so that all 256
  programs are resident and load their whole weight before the wait; ``o_whole_row_4``: 4 rows a program at 4 warps
  (512 programs, four an SM);
- ``gate_up_32x256``, ``gate_up_16x512``: gate/up with 32 or 16 rows a program and K steps of 256 or 512 at 4 warps
  (64 accumulators a thread still): 512 programs, one wave at four an SM, or 1024 programs, 1.9 waves;
  ``gate_up_32x256_stages3``: the first with Triton's pipeliner three stages deep over the K loop;
- ``down_8x1024``: the down projection (2048 x 8192) with K steps of 1024 at 4 warps (8 steps, four an SM);
- ``qkv_16x512``: q/k/v with 16 rows a program, K steps of 512 at 4 warps: 192 programs;
- ``..._compiled``: with ``compile=True``.

Measured at fd60ded, then removed with its switch: ``o_whole_row_merge_early``, ``o_whole_row`` with the split
merge releasing the next launch before its own wait, so that the o GEMV launched while the decode kernel ran and
loaded its weight then (entry 56 had measured this release with the two-step tiles: slower). The result files
``session_o_whole_row_b1_*.json`` come from this probe under its first name; those before d56749d name the variants
by the tiles of their day: their ``default`` is this ``norm_whole_row``, and their ``norm_two_steps`` /
``qkv_two_steps`` / ``gate_up_two_steps`` are this ``default`` / ``gate_up_whole_row`` / ``qkv_whole_row``.

Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays; the context grows
by 500 tokens over them), and the first step where its 32 greedy tokens part from ``default``'s (None: all equal;
another K step sums in another order, so the tiles may round an output the other way).

    python benchmarks/probes/session_gemv_tiles_b1.py --out benchmarks/probes/results/session_gemv_tiles_b1.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import gemv as gemv_kernels  # noqa: E402

WHOLE_ROW = "whole_row"  # harness.gemv_whole_row_config's tiles


def tiles(block_n: int, block_k: int, num_warps: int = 4, **options) -> dict:
    return dict(block_n=block_n, block_k=block_k, num_warps=num_warps, **options)


VARIANTS = {  # name: (compile, {projection: WHOLE_ROW or a config for gemv_triton})
    "default": (False, {}),
    "norm_whole_row": (False, {"qkv": WHOLE_ROW, "gate_up": WHOLE_ROW}),
    "qkv_whole_row": (False, {"qkv": WHOLE_ROW}),
    "gate_up_whole_row": (False, {"gate_up": WHOLE_ROW}),
    "qkv_whole_row_80": (False, {"qkv": tiles(8, 2048, 8, maxnreg=80)}),
    "o_whole_row": (False, {"o": WHOLE_ROW}),
    "o_whole_row_4": (False, {"o": tiles(4, 2048)}),
    "gate_up_32x256": (False, {"gate_up": tiles(32, 256)}),
    "gate_up_32x256_stages3": (False, {"gate_up": tiles(32, 256, num_stages=3)}),
    "gate_up_16x512": (False, {"gate_up": tiles(16, 512)}),
    "down_8x1024": (False, {"down": tiles(8, 1024)}),
    "qkv_16x512": (False, {"qkv": tiles(16, 512)}),
}
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}


def projection(n: int, k: int) -> str:
    """Which projection of the Llama-3.2-1B shape an ``[n, k]`` GEMV is (by shape; the LM head is ``head``)."""
    if k > 4096:
        return "down"
    if n == k:
        return "o"
    return "qkv" if n <= 2 * k else "gate_up" if n <= 16 * k else "head"


def timed_session(model, input_ids, compile: bool, overrides: dict) -> dict:
    gemv_config = gemv_kernels.gemv_config

    def probed_config(n: int, k: int) -> dict:
        override = overrides.get(projection(n, k))
        if override is None:
            return gemv_config(n, k)
        return harness.gemv_whole_row_config(k) if override == WHOLE_ROW else override

    gemv_kernels.gemv_config = probed_config
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        gemv_kernels.gemv_config = gemv_config


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="default")


if __name__ == "__main__":
    main()
