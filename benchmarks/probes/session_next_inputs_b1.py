"""Issue 29: a decode step's inputs written by the step before it, in a B=1 replayed step.

The profile at cc78c42 (``decode_step_kernels_b1_cc78c42.json``, entry 59) starts each replayed step with three torch
launches before the first GEMV, 6.6 µs of advance: the embedding of the token, the clamp of the position and the
gather of its cos and sin rows from the session's rotary table (4.2 µs in two inductor kernels compiled). They need
only the token and the position, which the step's end launch (``step_end.pick_and_advance``) has just written, so
that launch can write the next step's embedding row and rotary rows itself, and the step starts with its first
projection; the end launch's last program per row then loads one more row after the pick (an HBM latency).
Variants:

- ``step_embeds``: the step embeds its token and gathers its rotary rows itself (the session as it was, with
  ``decode_session._next_inputs_buffers`` made to return None in this process);
- ``next_inputs``: the end launch writes them (the session's default);
- ``..._compiled``: with ``compile=True``.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``) on
``bench_generate``'s model (bf16, a 512-token prompt, ``--max-cache-len`` and ``--replays`` as
``harness.session_probe_main`` takes them) in one process, the variants alternating over ``--rounds``. Per variant:
µs per replayed step, and the first step where its 32 greedy tokens part from ``step_embeds``' (None: all equal).

    python benchmarks/probes/session_next_inputs_b1.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.integrations import decode_session  # noqa: E402

VARIANTS = {"step_embeds": (False, False), "next_inputs": (False, True)}
VARIANTS |= {f"{name}_compiled": (True, switch) for name, (_, switch) in VARIANTS.items()}


def timed_session(model, input_ids, compile: bool, next_inputs: bool) -> dict:
    default = decode_session._next_inputs_buffers
    if not next_inputs:
        decode_session._next_inputs_buffers = lambda *args: None
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        decode_session._next_inputs_buffers = default


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="step_embeds")


if __name__ == "__main__":
    main()
