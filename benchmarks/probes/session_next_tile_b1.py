"""Issue 29: each GEMV K step's weight tile loaded before the step ahead of it computes, in a B=1 replayed step
(measured at 57c3624, then removed: 45-49 µs slower, the second tile's registers cost a program an SM).

A flashcore GEMV loads its first weight tile before its PDL wait; after the wait it reads the input row (for the
GEMVs that fold the RMSNorm, the whole row for its sum of squares first) and computes the first step, and only then
does the K loop load the next tile from HBM. At K 2048 (q/k/v, o, gate/up, the LM head) that second tile is half the
weight, and its latency comes after the input's. ``NEXT_TILE_FIRST`` issues each next tile's load before the step
ahead of it computes, so the second tile's load goes out right after the wait; it holds two tiles in registers at
once. Moving the epilogue's loads ahead saved 6-8 µs a step (``session_epilogue_loads_b1.py``, entry 58). This
probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s
model (bf16, a 512-token prompt, ``--max-cache-len`` and ``--replays`` as ``harness.session_probe_main`` takes them)
in one process, the variants alternating over ``--rounds``:

- ``in_loop``: ``gemv.NEXT_TILE_FIRST = False``, each tile loaded in its own step (the kernel until now);
- ``next_first``: each next tile loaded before the step ahead of it computes;
- ``..._compiled``: with ``compile=True``.

Per variant: µs per replayed step, and the first step where its 32 greedy tokens part from ``in_loop``'s (None: all
equal; only the loads move). Also what each GEMV compiled to (registers, spills, programs an SM), from Triton's cache.

    python benchmarks/probes/session_next_tile_b1.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from decode_step_kernels import gemv_compilations  # noqa: E402

from flashcore.kernels.triton import gemv  # noqa: E402

VARIANTS = {"in_loop": (False, False), "next_first": (False, True)}  # name: (compile, next tile first)
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}
REPORT: dict = {}  # what the GEMVs compiled to, refreshed after each session


def timed_session(model, input_ids, compile: bool, next_first: bool) -> dict:
    default = gemv.NEXT_TILE_FIRST
    gemv.NEXT_TILE_FIRST = next_first
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        gemv.NEXT_TILE_FIRST = default
        REPORT["gemv_compilations"] = gemv_compilations()


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="in_loop", report=REPORT)


if __name__ == "__main__":
    main()
