"""Issue 29: would a B=16 replayed decode step be faster with more KV splits?

Under capture the split count fills the SMs in one wave (``configs.num_kv_splits``): at B=16 on the Llama-3.2-1B
shape (8 KV heads, so 128 rows of the attention, on 132 SMs) that is one split, one program per SM, each streaming
its row's whole cached prefix alone, and no merge launch. In the B=16 profile the decode kernel takes 11.2-12.9 µs a
layer where 16 rows' K and V at 512-768 tokens take about 7 at the copy (entry 63). More splits put two or more
programs on an SM, more loads in flight, at the cost of the merge launch. This probe times a session's replayed
step with exactly ``--splits`` splits (within the split's minimum of 64 keys), in one process, the variants
alternating over ``--rounds`` rounds. Session options: ``fuse_projections`` and ``layer_kernels`` (no compile),
``max_cache_len`` 768, 16 random 512-token prompts; per variant the median over rounds of the median of 5 timings
of ``--replays`` replays, and the first step where row 0's 32 tokens part from the first variant's (the split
merge adds in another order, so they may part at a near-tie). Tokens are read from the session's text after the
warm-up, not copied per step (entry 64).

    python benchmarks/probes/decode_kv_splits_b16.py --out decode_kv_splits_b16.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

OPTIONS = dict(fuse_projections=True, layer_kernels=True)


def timed_session(model, input_ids, splits: int, replays: int) -> dict:
    from flashcore.kernels import configs
    from flashcore.kernels.gluon_sm90 import decode

    default = configs.num_kv_splits
    configs.num_kv_splits = lambda num_programs, capacity, device, wanted=0: default(
        num_programs, capacity, device, wanted=splits
    )
    decode.forget_launch_plans()  # the split count is cached per shape
    try:
        harness.SESSION_SHAPE.update(max_cache_len=768, replays=replays)
        return harness.session_steps(model, input_ids, **OPTIONS)
    finally:
        configs.num_kv_splits = default
        decode.forget_launch_plans()  # the split count is cached per shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--splits", default="1,2,3,4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--replays", type=int, default=40)
    args = parser.parse_args()
    device = torch.device("cuda")
    model, input_ids = harness.bench_model_and_prompts(16, device)
    splits = [int(s) for s in args.splits.split(",")]
    runs: dict[int, list[dict]] = {s: [] for s in splits}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for s in splits:
                runs[s].append(timed_session(model, input_ids, s, args.replays))
                print(s, round(runs[s][-1]["us_per_step"], 1), flush=True)
    reference = runs[splits[0]][0]["tokens"]
    rows = []
    for s, samples in runs.items():
        differing = [i for i, (a, b) in enumerate(zip(samples[0]["tokens"], reference, strict=True)) if a != b]
        rows.append({
            "splits": s,
            "us_per_step": statistics.median(sample["us_per_step"] for sample in samples),
            "samples_us": [sample["us_per_step"] for sample in samples],
            "tokens_stable_over_rounds": all(sample["tokens"] == samples[0]["tokens"] for sample in samples),
            "first_token_differing": differing[0] if differing else None,
        })  # fmt: skip
        print(rows[-1], flush=True)
    result = {"environment": harness.environment(device), "settings": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
