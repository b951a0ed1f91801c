"""Issue 29: the GEMVs' residual and rotary rows loaded before their PDL wait, in a B=1 replayed step (measured at
7abada7, then removed: slower).

A flashcore GEMV loads its first weight tile before ``gdc_wait``, but its epilogue's other operands after the K loop:
the residual (o and down projections) and the rotary rows (q/k/v). Those loads wait on memory after the products are
done, at the end of a kernel the next one waits on. Neither is written by the launch just before (a layer's input,
its attention's output, the step's cos and sin), so ``prefetch_epilogue`` loads them before the wait. Predicted: up to
one load latency (about 0.5-1 µs) off each of the three GEMVs a layer, 16-40 µs a step. This probe times a
``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model (bf16,
a 512-token prompt, ``--max-cache-len`` and ``--replays`` as ``harness.session_probe_main`` takes them) in one
process, the variants alternating over ``--rounds``:

- ``after_wait``: every GEMV with ``prefetch_epilogue=False`` (the kernel before this change);
- ``residual_first``: only the residual's load moved (o and down);
- ``prefetch``: the residual and the rotary rows (q/k/v from the second layer on), the default at 7abada7;
- ``..._compiled``: with ``compile=True``.

Per variant: µs per replayed step, and the first step where its 32 greedy tokens part from ``after_wait``'s (None:
all equal; the loads move, the arithmetic does not).

    python benchmarks/probes/session_prefetch_epilogue_b1.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import gemv as gemv_kernels  # noqa: E402

VARIANTS = {"after_wait": (False, "none"), "residual_first": (False, "residual"), "prefetch": (False, "all")}
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}  # (compile, prefetched)


def timed_session(model, input_ids, compile: bool, prefetched: str) -> dict:
    gemv_triton = gemv_kernels.gemv_triton

    def patched(*args, prefetch_epilogue: bool = False, **kwargs):
        if prefetched == "none" or (prefetched == "residual" and kwargs.get("cos") is not None):
            prefetch_epilogue = False
        return gemv_triton(*args, prefetch_epilogue=prefetch_epilogue, **kwargs)

    gemv_kernels.gemv_triton = patched
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        gemv_kernels.gemv_triton = gemv_triton


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="after_wait")


if __name__ == "__main__":
    main()
