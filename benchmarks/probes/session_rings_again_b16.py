"""Issue 29: entry 72's and entry 80's ring and split choices again, on a B=16 step with two KV splits.

The o projection (one K slice, a ring of 6) and the MLP in one launch (a gate/up ring of 2, the down projection's
first 2 tiles copied before its wait) were chosen by searches on the step of their day (NOTES.md, entries 72 and
80). Since 7eeab90 the attention before the o projection runs two programs to most SMs (entry 86), which changed
what two of its neighbours' settings cost. This probe searches a few of those choices again.

Variants: ``shipped``; ``o_split_2_ring_6`` and ``o_split_2_ring_4``, the o projection in two K slices (64
programs, the split-K ticket adding the two); ``down_prefetch_4`` and ``down_prefetch_0``, the down projection's
tiles copied before its wait; ``gate_up_ring_3``. ``DecodeSession`` with ``fuse_projections`` and
``layer_kernels`` (``bench_generate``'s ``kernels_session``), timed as ``harness.session_steps`` does.

    python benchmarks/probes/session_rings_again_b16.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import rows_gemm, rows_mlp  # noqa: E402

VARIANTS = {  # (o projection: K slices, ring; MLP config overrides)
    "shipped": ((0, 0), {}),
    "o_split_2_ring_6": ((2, 6), {}),
    "o_split_2_ring_4": ((2, 4), {}),
    "down_prefetch_4": ((0, 0), {"down_prefetch": 4}),
    "down_prefetch_0": ((0, 0), {"down_prefetch": 0}),
    "gate_up_ring_3": ((0, 0), {"gate_up_stages": 3}),
}


def timed_session(model, input_ids, o_plan: tuple, mlp_overrides: dict) -> dict:
    shipped_gemm, shipped_mlp_config = rows_gemm.tma_rows_gemm, rows_mlp.mlp_config
    split, ring = o_plan

    def o_on_its_plan(x, weight, bias, **options):
        if weight.shape[0] == weight.shape[1]:
            options.update(split_k=split, num_stages=ring)
        return shipped_gemm(x, weight, bias, **options)

    patches = contextlib.ExitStack()
    with patches:
        if split:
            patches.enter_context(mock.patch.object(rows_gemm, "tma_rows_gemm", o_on_its_plan))
        if mlp_overrides:
            config = lambda hidden, intermediate: {**shipped_mlp_config(hidden, intermediate), **mlp_overrides}  # noqa: E731
            patches.enter_context(mock.patch.object(rows_mlp, "mlp_config", config))
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
