"""Issue 29: which decode kernel a B=1 replayed step should run, the Gluon one or the Triton one.

On the H100 a decode call with fp16/bf16 and D 64 or 128 runs the warp-specialised Gluon kernel
(``flashcore/kernels/gluon_sm90/decode.py``; entries 30-31 measured it ahead on the attention benchmark's rows). In a
B=1 step of the Llama-3.2-1B shape its advance is 4.4-4.8 µs a layer for about 1.5 MB of K/V (entry 57's profile and
``decode_step_kernels_b1_702bba9.json``): the launch is latency, not bandwidth, and the Gluon kernel's setup (TMA
descriptors, barriers, a producer warp) is part of that latency. This probe times a ``DecodeSession``'s replayed
step (``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model (bf16, a 512-token prompt,
``--max-cache-len`` and ``--replays`` as ``harness.session_probe_main`` takes them) in one process, the variants
alternating over ``--rounds``:

- ``gluon``: the default dispatch;
- ``triton``: the Gluon decode kernel's ``supports`` refusing every call, so that the Triton attention kernel
  (split-KV, its merge a second launch under capture) takes the decode calls;
- ``..._compiled``: with ``compile=True``.

Per variant: µs per replayed step, and the first step where its 32 greedy tokens part from ``gluon``'s (None: all
equal; the two kernels sum in other orders, so bf16 tokens may part).

    python benchmarks/probes/session_decode_kernel_b1.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import decode  # noqa: E402

VARIANTS = {"gluon": (False, True), "triton": (False, False)}  # name: (compile, the Gluon kernel takes decode calls)
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}


def timed_session(model, input_ids, compile: bool, gluon: bool) -> dict:
    supports = decode.supports
    if not gluon:
        decode.supports = lambda call: False
    decode.forget_launch_plans()
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        decode.supports = supports
        decode.forget_launch_plans()


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="gluon")


if __name__ == "__main__":
    main()
