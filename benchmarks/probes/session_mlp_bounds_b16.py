"""Issue 29: bounds: the B=16 replayed step with parts of the one-launch MLP taken out.

The MLP (``kernels/gluon_sm90/rows_mlp.py``: gate/up with the SiLU-and-mul, then the down projection waiting per K
slice on the activations it reads, one launch) advances a B=16 layer by 40.8 µs for 100.7 MB of weight, 33.5 at the
copy (the profile at 44a0f42, entry 86): the layer's largest loss in µs. Where do the 7 µs go? This probe times a
``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on ``bench_generate``'s
model (bf16, 16 random 512-token prompts) in one process, the variants alternating over ``--rounds`` rounds.
``rows_mlp.tma_rows_mlp`` is wrapped while the session is built and captured so that every layer's MLP runs with
one of the kernel's probe switches, each of which takes one part out and gives wrong values:

- ``shipped``;
- ``gate_up_weightless``: no gate/up weight copies (each ring stage waits for its x tile alone; the MMAs read what
  shared memory holds);
- ``down_weightless``: no down-projection weight copies;
- ``no_slice_wait``: the down projection's programs do not wait for their K slice's activations;
- ``no_down_ticket``: no split-K sum: each of a down block's four programs writes its own slice's products, plus
  the residual, as the output.

Per variant: µs per replayed step (the bounds' tokens part from ``shipped``'s).

It runs at 4770ee4 only: the switches (``tma_rows_mlp``'s ``bounds``) were taken out after it (entry 89).

    python benchmarks/probes/session_mlp_bounds_b16.py --out session_mlp_bounds_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import torch  # noqa: E402

from flashcore.kernels.gluon_sm90 import rows_mlp  # noqa: E402
from flashcore.kernels.scratch import scratch_buffer  # noqa: E402

VARIANTS = {  # name: (the kernel's switch, or None)
    "shipped": (None,),
    "gate_up_weightless": ("GATE_UP_WEIGHTLESS",),
    "down_weightless": ("DOWN_WEIGHTLESS",),
    "no_slice_wait": ("NO_SLICE_WAIT",),
    "no_down_ticket": ("NO_DOWN_TICKET",),
}


def timed_session(model, input_ids, switch: str | None) -> dict:
    mlp = rows_mlp.tma_rows_mlp

    def with_switch(*args, **kwargs):
        return mlp(*args, **kwargs, bounds={switch: True})

    if switch is not None:
        rows_mlp.tma_rows_mlp = with_switch
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        rows_mlp.tma_rows_mlp = mlp
        # no_slice_wait leaves the slices' counts off zero (their last reader may zero them before every block
        # counted); the kernel expects zeros between launches.
        torch.cuda.synchronize()
        split = rows_mlp.mlp_config(model.config.hidden_size, model.config.intermediate_size)["down_split"]
        scratch_buffer("rows_mlp_flags", 2 * split, torch.int32, input_ids.device).zero_()


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
