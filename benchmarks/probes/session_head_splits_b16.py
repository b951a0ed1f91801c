"""Issue 29: the B=16 attention with each KV head's query heads shared by two programs instead of two KV splits.

Since 7eeab90 (entry 86) the Gluon decode kernel runs a B=16 step's 128 (row, KV head) programs as two KV splits:
256 programs, two to most SMs, each streaming half of its row's keys, and a merge launch after them (about 1.2 µs
a layer of the step's advance). Here each (row, KV head) instead runs two programs that stream all of its keys and
attend two of its four query heads each (``HEAD_SPLITS``): the same 256 programs and twice the bytes read through
L2 (each row's K/V once from memory, if the two programs read it at about the same time), but no partials and no
merge launch, and the o projection released right after the attention's wait, as with one split.

Variants: ``shipped`` (two KV splits, 128-key tiles, the merge launch); ``one_split`` (one program per row and KV
head, as before 7eeab90); ``head_splits_2`` and ``head_splits_2_64_keys`` (two programs per row and KV head, 128 or
64-key tiles). ``head_splits_2`` computes each query head as ``one_split`` does, so their tokens must be equal.
``DecodeSession`` with ``fuse_projections`` and ``layer_kernels`` (``bench_generate``'s ``kernels_session``), timed as
``harness.session_steps`` does.

    python benchmarks/probes/session_head_splits_b16.py --max-cache-len 768 --replays 40 --out x.json

It runs at 2b3fafa, whose decode kernel takes ``HEAD_SPLITS`` (``configs.gluon_decode_head_splits``); that commit's
change was reverted after this probe measured it slower than two KV splits (NOTES.md, entry 87).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels import configs  # noqa: E402
from flashcore.kernels.gluon_sm90 import decode  # noqa: E402

VARIANTS = {  # (head splits, KV splits or None for the shipped rule, keys per tile or None)
    "shipped": (1, None, None),
    "one_split": (1, 1, None),
    "head_splits_2": (2, None, None),
    "head_splits_2_64_keys": (2, None, 64),
}


def timed_session(model, input_ids, head_splits: int, kv_splits: int | None, block_n: int | None) -> dict:
    patches = contextlib.ExitStack()
    with patches:
        patches.callback(decode.forget_launch_plans)
        patches.enter_context(mock.patch.object(configs, "gluon_decode_head_splits", lambda *_: head_splits))
        if kv_splits is not None:
            patches.enter_context(mock.patch.object(configs, "gluon_decode_kv_splits", lambda *_: kv_splits))
        if block_n is not None:
            patches.enter_context(mock.patch.object(configs, "gluon_decode_block_n", lambda *_: block_n))
        decode.forget_launch_plans()
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="one_split", batch=16)


if __name__ == "__main__":
    main()
