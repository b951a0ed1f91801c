"""Issue 29: a B=16 replayed decode step with the attention's K/V in two or more splits, merged in the same launch.

At B=16 on the Llama-3.2-1B shape the Gluon decode kernel runs one program per row and KV head (128 on 132 SMs),
one split each: each SM streams one row's 512-768 cached keys through two stages, and the kernel advances the step
by 8.3-9.5 µs a layer against 7 at the copy (NOTES.md, entries 63 and 85). Entry 65 tried 2-4 splits, each with
the merge in a second launch (what a captured step does, ``split_merge.merges_in_attention_launch``): 21-57 µs a
step slower. Here the splits merge in the attention launch, as they do eagerly: the last split of each row and KV
head to finish combines the partials, so no launch is added, and each SM streams two programs' tiles at once.

Variants: ``shipped`` (one split); ``in_launch_<n>``, n splits merged in the launch; ``separate_<n>``, n splits
merged in a second launch (entry 65's); ``separate_2_block_128``, two splits of 128-key tiles (the kernel's choice
is 64 where programs share an SM, ``configs.gluon_decode_block_n``). ``DecodeSession`` with ``fuse_projections``
and ``layer_kernels`` (``bench_generate``'s ``kernels_session``), timed as ``harness.session_steps`` does.

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

VARIANTS = {
    "shipped": (1, False, 0),
    "in_launch_2": (2, True, 0),
    "in_launch_3": (3, True, 0),
    "in_launch_4": (4, True, 0),
    "separate_2": (2, False, 0),
    "separate_2_block_128": (2, False, 128),
    "separate_3": (3, False, 0),
    "separate_4": (4, False, 0),
}


def timed_session(model, input_ids, splits: int, in_launch: bool, block_n: int) -> dict:
    default_splits = configs.num_kv_splits

    def forced_splits(num_programs, capacity, device, wanted=0):
        return default_splits(num_programs, capacity, device, wanted=splits)

    patches = contextlib.ExitStack()
    with patches:
        patches.enter_context(mock.patch.object(configs, "num_kv_splits", forced_splits))
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
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="separate_2", batch=16)


if __name__ == "__main__":
    main()
