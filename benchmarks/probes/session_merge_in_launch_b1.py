"""Issue 29: the KV-split merge inside the attention launch, in a B=1 replayed step (again, after entry 57).

Under graph capture the Gluon decode kernel's KV splits are merged by a second launch (``split_merge
.merges_in_attention_launch``); entry 44 measured the merge inside the decode launch 5% slower per replayed step at
B=1, before the projections ran on flashcore's GEMV under programmatic dependent launch. Since then a step's
profile (``decode_step_kernels.py``) shows each kernel boundary costing a few µs whatever the kernel does: per layer
the decode kernel's advance is 4.4 µs, the merge's 1.5 and the o GEMV's 6.0 for 8.4 MB. This probe times a
``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model
(bf16, a 512-token prompt, ``max_cache_len=2048``) in one process, the variants alternating over ``--rounds``:

- ``separate``: the default, the merge in its own launch;
- ``in_launch``: the policy forced to merge in the attention launch while capturing too (the last split of each
  KV head merges, and the o GEMV launches when the decode kernel ends);
- ``in_launch_release`` (measured at 174133c, then removed with its switch): the same, with the decode kernel
  releasing the next launch after its wait, as it does before a separate merge, so that the o GEMV loaded its first
  tiles during the attention;
- ``..._compiled``: with ``compile=True``.

Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays), and the first
step where its 32 greedy tokens part from ``separate``'s (None: all equal).

    python benchmarks/probes/session_merge_in_launch_b1.py --out session_merge_in_launch_b1.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import decode  # noqa: E402
from flashcore.kernels.triton import split_merge  # noqa: E402

VARIANTS = {"separate": (False, False), "in_launch": (False, True)}  # name: (compile, merge in the attention launch)
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}


def timed_session(model, input_ids, compile: bool, in_launch: bool) -> dict:
    policy = split_merge.merges_in_attention_launch
    if in_launch:
        split_merge.merges_in_attention_launch = lambda device: True
    decode.forget_launch_plans()
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        split_merge.merges_in_attention_launch = policy
        decode.forget_launch_plans()


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="separate")


if __name__ == "__main__":
    main()
