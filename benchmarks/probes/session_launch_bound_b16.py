"""Issue 29: what one launch of little work costs in a B=16 replayed step's chain.

NOTES.md (entries 80-84) puts most of what a B=16 step loses against its bytes on the kernel boundaries of its
chain, about 100 a step. The add-and-norm launch between a layer's o projection and its MLP (the residual add and the
MLP's RMSNorm: 16 rows of 2048, 128 KB read) is the step's smallest: its work is next to nothing, so what it costs
is its boundary. ``no_add_norm`` takes its 16 launches out (``layer_ops.add_rms_norm`` hands back its inputs as the
sum and the normed rows, with no launch); the MLP then reads the o projection's output unnormalized. Its tokens are
wrong; only the time counts. ``shipped``: the session as it is. ``DecodeSession`` with ``fuse_projections`` and
``layer_kernels`` (``bench_generate``'s ``kernels_session``), timed as ``harness.session_steps`` does, B=16.

    python benchmarks/probes/session_launch_bound_b16.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore import layer_ops  # noqa: E402

VARIANTS = {"shipped": (False,), "no_add_norm": (True,)}


def timed_session(model, input_ids, skip_add_norm: bool) -> dict:
    no_launch = lambda attn_output, residual, weight, eps: (residual, attn_output)  # noqa: E731
    with mock.patch.object(layer_ops, "add_rms_norm", no_launch) if skip_add_norm else contextlib.nullcontext():
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
