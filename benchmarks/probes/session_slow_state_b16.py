"""Issue 29: which kernels make a B=16 ``DecodeSession``'s step about 70 µs slower from the fourth one of a process on.

``probes/session_add_norm_b16.py`` (entry 63) alternated two variants of a ``DecodeSession`` (the add after attention
and the MLP's norm as two launches or one) and found the first three of the process stepping in 1433-1453 µs and
every later one in 1502-1528. This probe alternates the two variants the same way, ``--sessions`` times, and
profiles each one's replayed steps with ``decode_step_kernels.profile_variant`` (``fuse_projections``,
``layer_kernels``, no compile): the span and each category's advance, in order. ``profile_variant`` does not clone
the warm-up tokens, and at 5bbb2ac every one stayed fast: ``probes/session_placement_b16.py --clone --profile``
later reproduced the slow state and profiled it.

    python benchmarks/probes/session_slow_state_b16.py --out session_slow_state_b16.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_step_kernels  # noqa: E402
import harness  # noqa: E402

from flashcore.integrations import layer_kernels  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    model, input_ids = harness.bench_model_and_prompts(16, device)
    runs_kernel_norm = layer_kernels.runs_kernel_norm
    rows = []
    with torch.inference_mode():
        for index in range(args.sessions):
            fused = index % 2 == 1
            layer_kernels.runs_kernel_norm = runs_kernel_norm if fused else (lambda norm: False)
            try:
                profile = decode_step_kernels.profile_variant(
                    model, input_ids, dict(fuse_projections=True, layer_kernels=True), args.steps
                )
            finally:
                layer_kernels.runs_kernel_norm = runs_kernel_norm
            profile.pop("median_step")
            rows.append({"session": index, "variant": "fused" if fused else "separate", **profile})
            summary = {key: round(value, 1) for key, value in profile["advance_us_by_category"].items()}
            print(index, rows[-1]["variant"], round(profile["span_us_median"], 1), summary, flush=True)
    result = {"environment": harness.environment(device), "settings": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
