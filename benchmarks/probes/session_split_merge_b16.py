"""Issue 29: a B=16 replayed decode step with the attention's cached K/V in one split or more, merged in a second
launch or in the attention launch.

At B=16 on the Llama-3.2-1B shape the Gluon decode kernel has one program per row and KV head (128 on 132 SMs).
With one split each SM streams one row's 512-768 cached keys through two stages, and the kernel advanced the step
by 8.3-9.5 µs a layer against 7 at the copy (NOTES.md, entries 63 and 85). Entry 65 tried 2-4 splits with the
merge in a second launch (what a captured step does, ``split_merge.merges_in_attention_launch``), 21-57 µs a step
slower, on the kernels of then. Two splits put two programs on most SMs, each streaming half a row; merged in the
attention launch, the last split of each row and KV head combines the partials, and no launch is added.

Variants: ``shipped``, the kernel's own choice (``configs.gluon_decode_kv_splits``: since 7eeab90 two splits of
128-key tiles, merged in a second launch under capture; before, one split); ``one_split``; ``in_launch_<n>``, n
splits merged in the launch; ``separate_<n>``, n splits merged in a second launch (entry 65's); ``two_splits_64``,
two splits of 64-key tiles (``configs.gluon_decode_block_n`` before 7eeab90). ``DecodeSession`` with
``fuse_projections`` and ``layer_kernels`` (``bench_generate``'s ``kernels_session``), timed as
``harness.session_steps`` does. The results at d4db64c and 503738d are from the version before 7eeab90, whose
``shipped`` was one split and ``separate_2`` two of 64-key tiles.

    python benchmarks/probes/session_split_merge_b16.py --max-cache-len 768 --replays 40 --out x.json
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
from flashcore.kernels.triton import split_merge  # noqa: E402

VARIANTS = {  # (splits, 0: the kernel's own; merged in the attention launch; keys per tile, 0: the kernel's own)
    "shipped": (0, False, 0),
    "one_split": (1, False, 0),
    "two_splits_64": (2, False, 64),
    "in_launch_2": (2, True, 0),
    "separate_3": (3, False, 0),
    "separate_4": (4, False, 0),
}


def timed_session(model, input_ids, splits: int, in_launch: bool, block_n: int) -> dict:
    default_splits = configs.num_kv_splits

    def forced_splits(num_programs, capacity, device, wanted=0):
        return default_splits(num_programs, capacity, device, wanted=splits)

    patches = contextlib.ExitStack()
    with patches:
        if splits:
            patches.enter_context(mock.patch.object(configs, "gluon_decode_kv_splits", forced_splits))
        if block_n:
            patches.enter_context(mock.patch.object(configs, "gluon_decode_block_n", lambda *args: block_n))
        if in_launch:
            patches.enter_context(mock.patch.object(split_merge, "merges_in_attention_launch", lambda device: True))
        decode.forget_launch_plans()  # the split count is cached per shape
        try:
            return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
        finally:
            decode.forget_launch_plans()


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
