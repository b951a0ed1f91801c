"""Issue 29: the RoPE kernel with 16 heads a program against one, in a B=16 replayed decode step.

Entry 66 gave each program of the RoPE kernel up to 16 heads of one token (``layer_kernels.ROTARY_HEADS_PER_PROGRAM``)
where it had one, for the prefill, whose 16 x 512 tokens made 327,680 one-warp programs a layer. A decode step of 16
rows has 16 tokens: 640 programs before, 48 after. This probe times a ``DecodeSession``'s replayed step
(``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model (bf16, 16 random 512-token prompts) in one
process, the variants alternating over ``--rounds`` rounds: ``heads_1`` (one head a program) and ``heads_16`` (as
shipped). Per variant: µs per replayed step, and the first step where row 0's 32 tokens part from ``heads_1``'s
(the same roundings, so None is expected).

    python benchmarks/probes/session_rotary_heads_b16.py --out session_rotary_heads_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import layer_kernels  # noqa: E402

VARIANTS = {"heads_1": (1,), "heads_16": (16,)}  # name: (heads per program, at most)


def timed_session(model, input_ids, heads: int) -> dict:
    shipped = layer_kernels.ROTARY_HEADS_PER_PROGRAM
    layer_kernels.ROTARY_HEADS_PER_PROGRAM = heads
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        layer_kernels.ROTARY_HEADS_PER_PROGRAM = shipped


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="heads_1", batch=16)


if __name__ == "__main__":
    main()
