"""Issue 29: where a GEMV's epilogue loads its residual and rotary rows, in a B=1 replayed step (measured at 1ca2023;
``after_loop`` kept, then the switch removed).

``flashcore/kernels/triton/gemv.py`` loaded the residual (o and down projections) and the rotary rows (q/k/v) where the
epilogue uses them: after the reduction and the rounding, the rotary rows inside the branch of the programs that
rotate. Each is then a memory latency in series at the end of a kernel that the next one waits on. Issued right after
the K loop, before the reduction, they overlap it. Loading them even before the PDL wait was slower
(``session_prefetch_epilogue_b1.py``, 7abada7), but that probe's reference already loaded them after the loop, and
on another H100 than the run before it its step was 10 µs shorter. This probe times a ``DecodeSession``'s replayed
step (``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model (bf16, a 512-token prompt,
``--max-cache-len`` and ``--replays`` as ``harness.session_probe_main`` takes them) in one process, the variants
alternating over ``--rounds``:

- ``at_use``: ``gemv.EPILOGUE_LOADS_FIRST = False``, the loads where the epilogue uses them (the kernel until now);
- ``after_loop``: the loads right after the K loop;
- ``..._compiled``: with ``compile=True``.

Per variant: µs per replayed step, and the first step where its 32 greedy tokens part from ``at_use``'s (None: all
equal; only the loads move).

    python benchmarks/probes/session_epilogue_loads_b1.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import gemv  # noqa: E402

VARIANTS = {"at_use": (False, False), "after_loop": (False, True)}  # name: (compile, loads first)
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}


def timed_session(model, input_ids, compile: bool, loads_first: bool) -> dict:
    default = gemv.EPILOGUE_LOADS_FIRST
    gemv.EPILOGUE_LOADS_FIRST = loads_first
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        gemv.EPILOGUE_LOADS_FIRST = default


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="at_use")


if __name__ == "__main__":
    main()
