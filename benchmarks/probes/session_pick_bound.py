"""Issue 29: what the greedy pick of a replayed decode step costs beyond a pick over the LM head's block maxima.

The issue lists "the LM head and the greedy pick fused, so the logits never round-trip" among its ideas. A step
ends with the LM head (a GEMM of V = 128256 outputs per row, written as bf16 logits) and one launch
(``step_end.pick_and_advance``) whose 126 programs per row each reduce 1024 logits, the row's last one picking the
best chunk and writing the next step's inputs (``decode_step_kernels_b16_50032a3.json``: 6.5 µs of advance at
B=16). Fused, the LM head's epilogue would write each 64-output block's maximum and its index (2004 per row), and the
end launch would pick among those.

This probe bounds what the end launch would save, without the fused epilogue: ``pick_2048`` hands the end launch only
each row's first 2048 logits (2 programs a row), about the bytes of the 2004 block maxima and indices; the LM head
still writes every logit. The tokens of ``pick_2048`` are then wrong (the best of the first 2048 ids); the probe
reports the step time only. ``shipped``: the session as it is. ``DecodeSession`` with ``fuse_projections`` and
``layer_kernels`` (``bench_generate``'s ``kernels_session``), timed as ``harness.session_steps`` does.

    python benchmarks/probes/session_pick_bound.py --batch 16 --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.integrations import decode_session  # noqa: E402

VARIANTS = {"shipped": (None,), "pick_2048": (2048,)}


def timed_session(model, input_ids, columns: int | None) -> dict:
    shipped = decode_session.pick_and_advance
    first_columns = lambda scores, *rest: shipped(scores[:, :columns], *rest)  # noqa: E731
    with mock.patch.object(decode_session, "pick_and_advance", first_columns) if columns else contextlib.nullcontext():
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
