"""Issue 29: the attention's launches releasing the next kernel before their PDL wait, in a B=1 replayed step
(measured at 3da0de4; ``merge_first`` kept, then the switches removed).

With the decode kernel's K/V copies issued before its wait (entry 59), the per-layer profile
(``decode_step_kernels_b1_cc78c42.json``) has the split merge at 0.85 µs of advance and the o GEMV after it at
6.85 µs, 4 µs over its 8.4 MB of weights at 3 TB/s: the o GEMV launches when the merge releases it, after the merge's
wait, and has the merge's 0.85 µs to stream its weights before its own wait returns. Released earlier, it streams
them during the attention. Entry 56 measured the merge's early release 3-12 µs slower, before the decode kernel's
copies moved ahead of its wait. Variants (switches ``split_merge.RELEASE_FIRST`` and ``decode.RELEASE_FIRST``):

- ``after_wait``: both release after their wait (the kernels until now);
- ``merge_first``: the merge releases the o GEMV before its wait;
- ``both_first``: the decode kernel releases the merge before its wait too, so that the o GEMV can launch during
  the decode kernel;
- ``..._compiled``: with ``compile=True``.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``) on
``bench_generate``'s model (bf16, a 512-token prompt, ``--max-cache-len`` and ``--replays`` as
``harness.session_probe_main`` takes them) in one process, the variants alternating over ``--rounds``. Per variant:
µs per replayed step, and the first step where its 32 greedy tokens part from ``after_wait``'s (None: all equal).

    python benchmarks/probes/session_early_release_b1.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import decode  # noqa: E402
from flashcore.kernels.triton import split_merge  # noqa: E402

# name: (compile, merge releases first, decode releases first)
VARIANTS = {"after_wait": (False, False, False), "merge_first": (False, True, False), "both_first": (False, True, True)}
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}


def timed_session(model, input_ids, compile: bool, merge_first: bool, decode_first: bool) -> dict:
    defaults = split_merge.RELEASE_FIRST, decode.RELEASE_FIRST
    split_merge.RELEASE_FIRST, decode.RELEASE_FIRST = merge_first, decode_first
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        split_merge.RELEASE_FIRST, decode.RELEASE_FIRST = defaults


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="after_wait")


if __name__ == "__main__":
    main()
