"""Issue 29: the Triton decode kernel against the Gluon one, in a B=16 replayed step.

The Gluon decode kernel (``flashcore/kernels/gluon_sm90/decode.py``) takes every sm_90 decode call it can; entry 58
found the Triton kernel slower in a B=1 step. At B=16 the Gluon kernel's 128 programs take 11.2-12.9 µs a layer for
about 20 MB of K/V, about 7 µs at the copy (entry 63), and more stages did not help (entry 67). This probe times a
``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on ``bench_generate``'s
model (bf16, 16 random 512-token prompts) in one process, the variants alternating over ``--rounds`` rounds:

- ``gluon``: as shipped;
- ``triton``: the Gluon decode kernel's ``supports`` answering False while the session is built and captured, so
  the dispatch table gives its calls to the Triton kernel (with its own KV splits and merge).

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``gluon``'s (another
summation order: they may part at a near-tie).

    python benchmarks/probes/session_decode_kernel_b16.py --out session_decode_kernel_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import decode  # noqa: E402

VARIANTS = {"gluon": (True,), "triton": (False,)}  # name: (the Gluon decode kernel)


def timed_session(model, input_ids, gluon: bool) -> dict:
    supports = decode.supports
    if not gluon:
        decode.supports = lambda call: False
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        decode.supports = supports


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="gluon", batch=16)


if __name__ == "__main__":
    main()
