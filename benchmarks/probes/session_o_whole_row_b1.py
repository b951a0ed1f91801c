"""Issue 29: the GEMVs' tiles around the attention call in a B=1 replayed step.

A GEMV program owns 8 rows and walks K (``flashcore/kernels/triton/gemv.py``). ``gemv_config``'s tiles for K 2048
take two K steps of 1024 at 4 warps; its ``whole_row`` tiles one step of 2048 at 8 warps and at most 128 registers a
thread, two programs an SM, so that a program loads all of its weight before its PDL wait. Until entry 57 the
GEMVs that compute the RMSNorm (q/k/v and gate/up) took the whole-row tiles, which read the input row once for both
the norm's sum and the products; since then every GEMV takes the two-step tiles. This probe times a
``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model (the
Llama-3.2-1B shape, bf16, a 512-token prompt, ``max_cache_len=2048``) in one process, the variants alternating over
``--rounds`` rounds:

- ``default``: ``gemv_config``'s tiles everywhere;
- ``norm_whole_row``: the q/k/v and gate/up GEMVs on the whole-row tiles (the default before entry 57);
- ``qkv_whole_row`` / ``gate_up_whole_row``: one of them (q/k/v: ``n <= 2 * k``, 3072 x 2048 here, 384 programs,
  one wave at four an SM and 1.45 waves at two; gate/up: 16384 x 2048, 2048 programs);
- ``qkv_whole_row_80``: q/k/v on the whole-row tiles at 80 registers a thread, three programs an SM: one wave, the
  row read once (the accumulators and the weight tile may then spill);
- ``o_whole_row``: the o projection (``n == k`` without the norm, 2048 x 2048 here, with the residual add) on the
  whole-row tiles, so that all 256 programs are resident and load their whole weight before the wait;
- ``o_whole_row_4``: the same with 4 rows a program at 4 warps (512 programs, four an SM);
- ``..._compiled``: with ``compile=True``.

Measured at fd60ded, then removed with its switch: ``o_whole_row_merge_early``, ``o_whole_row`` with the split
merge releasing the next launch before its own wait, so that the o GEMV launched while the decode kernel ran and
loaded its weight then (entry 56 had measured this release with the two-step tiles: slower). Result files before
d56749d name the variants by the tiles of their day: their ``default`` is this ``norm_whole_row``, and their
``norm_two_steps`` / ``qkv_two_steps`` / ``gate_up_two_steps`` are this ``default`` / ``gate_up_whole_row`` /
``qkv_whole_row``.

Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays; the context grows
by 500 tokens over them), and the first step where its 32 greedy tokens part from ``default``'s (None: all equal;
the norm's sum runs in K-step chunks, so the tiles may round an input the other way).

    python benchmarks/probes/session_o_whole_row_b1.py --out benchmarks/probes/results/session_o_whole_row_b1.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import gemv as gemv_kernels  # noqa: E402

VARIANTS = {  # name: (compile, the GEMVs on whole-row tiles, registers a thread of q/k/v's, rows a program of o's)
    "default": (False, (), None, 0),
    "norm_whole_row": (False, ("qkv", "gate_up"), None, 0),
    "qkv_whole_row": (False, ("qkv",), None, 0),
    "gate_up_whole_row": (False, ("gate_up",), None, 0),
    "qkv_whole_row_80": (False, ("qkv",), 80, 0),
    "o_whole_row": (False, ("o",), None, 8),
    "o_whole_row_4": (False, ("o",), None, 4),
}
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}


def projection(n: int, k: int) -> str:
    """Which projection of the Llama-3.2-1B shape an ``[n, k]`` GEMV is (by shape; the LM head is ``head``)."""
    if k > 4096:
        return "down"
    if n == k:
        return "o"
    return "qkv" if n <= 2 * k else "gate_up" if n <= 16 * k else "head"


def timed_session(model, input_ids, compile: bool, whole_row: tuple, qkv_registers: int | None, o_rows: int) -> dict:
    gemv_config = gemv_kernels.gemv_config

    def probed_config(n: int, k: int, whole_row_: bool = False) -> dict:
        name = projection(n, k)
        if name not in whole_row:
            return gemv_config(n, k)
        config = gemv_config(n, k, whole_row=True)
        if name == "qkv" and qkv_registers:
            config = dict(config, maxnreg=qkv_registers)
        if name == "o" and o_rows == 4:
            config = dict(config, block_n=4, num_warps=4, maxnreg=None)
        return config

    gemv_kernels.gemv_config = probed_config
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        gemv_kernels.gemv_config = gemv_config


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="default")


if __name__ == "__main__":
    main()
