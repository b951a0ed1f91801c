"""Issue 29: the Gluon decode kernel's pipeline stages and key tile, in a B=16 replayed step.

At a B=16 step of ``bench_generate``'s model the decode kernel runs 128 programs (16 rows x 8 KV heads, one split),
one wave, each streaming about 640 keys of K and V in 128-key tiles through 2 stages; entry 63's profile has it at
11.2-12.9 µs a layer, where its 20 MB of K/V take about 7 µs at the copy. Entry 30 chose 2 stages on split rows,
where programs share an SM; here each program is alone on its SM with 5 tiles to stream. This probe times a
``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on ``bench_generate``'s
model (bf16, 16 random 512-token prompts) in one process, the variants alternating over ``--rounds`` rounds:

- ``stages2_keys128``: as shipped;
- ``stages3_keys128``, ``stages4_keys128``: more stages (``decode.CONFIG`` replaced while the session is built and
  captured);
- ``stages4_keys64``: 4 stages of 64-key tiles (``configs.gluon_decode_block_n`` replaced too, and the
  kernel's per-shape plan cleared around each session).

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from the shipped variant's (the
same sums in the same order, so None is expected).

    python benchmarks/probes/session_decode_stages_b16.py --out session_decode_stages_b16.json --max-cache-len 768
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels import configs  # noqa: E402
from flashcore.kernels.gluon_sm90 import decode  # noqa: E402

VARIANTS = {  # name: (stages, keys per tile or None for the shipped choice)
    "stages2_keys128": (2, None),
    "stages3_keys128": (3, None),
    "stages4_keys128": (4, None),
    "stages4_keys64": (4, 64),
}


def timed_session(model, input_ids, stages: int, keys: int | None) -> dict:
    config, block_n = decode.CONFIG, configs.gluon_decode_block_n
    decode.CONFIG = dataclasses.replace(config, num_stages=stages)
    if keys is not None:
        configs.gluon_decode_block_n = lambda *args: keys
    decode._launch_plan.cache_clear()  # per shape, keeps the tile it computed first
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        decode.CONFIG, configs.gluon_decode_block_n = config, block_n
        decode._launch_plan.cache_clear()


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="stages2_keys128", batch=16)


if __name__ == "__main__":
    main()
