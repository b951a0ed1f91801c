"""Issue 29: would a replayed decode step be faster with the KV-split merge inside the attention launch?

Under graph capture the decode kernels merge their KV splits in a second launch (``split_merge
.merges_in_attention_launch``; NOTES.md, entry 20, measured on attention calls alone). In a B=1 session step on the
Llama-3.2-1B shape that second launch is 16 of the step's kernels and 74 µs (entry 44). This probe times a session's
replayed step both ways, in one process: ``separate`` (the default) and ``in_launch`` (the policy forced to merge in
the attention launch while capturing too), for ``--batches``. Session options: ``fuse_projections`` and
``layer_kernels`` (no compile, so no compile time), after a 512-token prefill. Per variant and batch: the median of 7
timings of 100 replays (CUDA events), and whether the tokens equal the default's.

    python benchmarks/probes/merge_in_launch_capture.py --out benchmarks/probes/results/merge_in_launch_capture.json
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
from bench_generate import build_config, build_model  # noqa: E402

OPTIONS = dict(fuse_projections=True, layer_kernels=True)
REPLAYS, TIMINGS = 100, 7


def timed_session(model, input_ids, in_launch: bool) -> dict:
    from flashcore.integrations.decode_session import DecodeSession
    from flashcore.kernels.triton import split_merge

    default_policy = split_merge.merges_in_attention_launch
    if in_launch:
        split_merge.merges_in_attention_launch = lambda device: True
    try:
        session = DecodeSession(model, max_cache_len=2048, batch_size=input_ids.shape[0], **OPTIONS)
        tokens = [session.prefill(input_ids).clone()]
        tokens += [session.decode_step().clone() for _ in range(31)]  # eager warm-up, capture, replays
    finally:
        split_merge.merges_in_attention_launch = default_policy
    timings = [1e3 * ms for ms in harness.ms_per_call_repeated(session.decode_step, REPLAYS, TIMINGS)]
    return {"us_per_step": statistics.median(timings), "timings_us": timings, "tokens": torch.stack(tokens, 1).tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args()
    device = torch.device("cuda")
    config = build_config(is_tiny=False)
    model = build_model(config, device)
    generator = torch.Generator().manual_seed(0)
    result = {"environment": harness.environment(device), "settings": vars(args), "rows": []}
    for batch in [int(b) for b in args.batches.split(",")]:
        input_ids = torch.randint(3, config.vocab_size, (batch, 512), generator=generator).to(device)
        with torch.inference_mode():
            # Alternating, twice each, so that a drift of the GPU's clock reaches both.
            runs = {name: [] for name in ("separate", "in_launch")}
            for _ in range(2):
                for name in runs:
                    runs[name].append(timed_session(model, input_ids, in_launch=name == "in_launch"))
        row = {"B": batch}
        for name, samples in runs.items():
            row[f"{name}_us"] = statistics.median(s["us_per_step"] for s in samples)
            row[f"{name}_samples_us"] = [s["us_per_step"] for s in samples]
        row["in_launch_over_separate"] = row["separate_us"] / row["in_launch_us"]
        row["tokens_equal"] = all(s["tokens"] == runs["separate"][0]["tokens"] for r in runs.values() for s in r)
        result["rows"].append(row)
        print(f"B={batch}: separate {row['separate_us']:.1f} us, in launch {row['in_launch_us']:.1f} us "
              f"({row['in_launch_over_separate']:.3f}x), tokens equal {row['tokens_equal']}", flush=True)  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
