"""Issue 29: the Gluon decode kernel at one KV split releasing the next kernel after its wait, in a B=16 step.

At B=16 the decode kernel runs one program per row and KV head (128) and no KV split. Its programs released the
next kernel, the o projection, only by finishing, so the o projection's programs (the TMA few-row GEMM, entry 72)
copied their first weight tiles only once the attention was done. With ``decode.ONE_SPLIT_RELEASES`` each program
releases it right after its wait, as the other kernels do. This probe times a ``DecodeSession``'s replayed step
(``fuse_projections`` and ``layer_kernels``, no compile) on ``bench_generate``'s model (bf16, 16 random 512-token
prompts), the variants alternating over ``--rounds`` rounds (the decode kernel's cached launches dropped before each
session):

- ``release_after_wait``: shipped since entry 75;
- ``release_at_exit``: as before.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``release_after_wait``'s
(the bits cannot change: only when the next kernel starts does).

    python benchmarks/probes/session_decode_release_b16.py --out session_decode_release_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import decode  # noqa: E402

VARIANTS = {"release_after_wait": (True,), "release_at_exit": (False,)}


def timed_session(model, input_ids, release: bool) -> dict:
    shipped = decode.ONE_SPLIT_RELEASES
    decode.ONE_SPLIT_RELEASES = release
    decode.forget_launch_plans()
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        decode.ONE_SPLIT_RELEASES = shipped
        decode.forget_launch_plans()


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="release_after_wait", batch=16)


if __name__ == "__main__":
    main()
