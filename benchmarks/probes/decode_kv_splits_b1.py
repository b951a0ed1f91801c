"""Issue 29: would a B=1 replayed decode step be faster with fewer KV splits?

Under capture the split count follows the cache's capacity, not the row's length (``configs.num_kv_splits``): at
B=1 on the Llama-3.2-1B shape (8 KV heads, 132 SMs) that is 16 splits, each a program of its own, and a merge
launch after the attention launch. At 512-768 tokens of context each split holds one 64-key tile. This probe times a
session's replayed step with the split count capped at ``--splits`` (16 is the default's; 1 has no merge launch),
after prefills of ``--prompt-lens`` tokens, in one process, alternating the variants twice. Session options:
``fuse_projections`` and ``layer_kernels`` (no compile), ``max_cache_len=2048``. Per variant and prompt length: the
median of 5 timings of 100 replays (CUDA events; the context grows by 500 tokens over them), and whether the tokens
equal the default's.

    python benchmarks/probes/decode_kv_splits_b1.py --out benchmarks/probes/results/decode_kv_splits_b1.json
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
REPLAYS, TIMINGS = 100, 5


def timed_session(model, input_ids, max_splits: int) -> dict:
    from flashcore.integrations.decode_session import DecodeSession
    from flashcore.kernels import configs
    from flashcore.kernels.gluon_sm90 import decode

    def forget_plans() -> None:  # the split count is cached per shape
        decode._launch_plan.cache_clear()
        decode._bound_launches.clear()

    default = configs.num_kv_splits
    configs.num_kv_splits = lambda *args, **kwargs: min(default(*args, **kwargs), max_splits)
    forget_plans()
    try:
        session = DecodeSession(model, max_cache_len=2048, batch_size=input_ids.shape[0], **OPTIONS)
        tokens = [session.prefill(input_ids).clone()]
        tokens += [session.decode_step().clone() for _ in range(31)]  # eager warm-up, capture, replays
        timings = [1e3 * ms for ms in harness.ms_per_call_repeated(session.decode_step, REPLAYS, TIMINGS)]
    finally:
        configs.num_kv_splits = default
        forget_plans()
    return {"us_per_step": statistics.median(timings), "timings_us": timings, "tokens": torch.stack(tokens, 1).tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--splits", default="16,8,4,2,1")
    parser.add_argument("--prompt-lens", default="512,1400")
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_model(build_config(is_tiny=False), device)
    generator = torch.Generator().manual_seed(0)
    result = {"environment": harness.environment(device), "settings": vars(args), "rows": []}
    splits = [int(s) for s in args.splits.split(",")]
    for prompt_len in [int(n) for n in args.prompt_lens.split(",")]:
        input_ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=generator).to(device)
        runs = {s: [] for s in splits}
        with torch.inference_mode():
            for _ in range(2):  # alternating, so that a drift of the GPU's clock reaches every variant
                for s in splits:
                    runs[s].append(timed_session(model, input_ids, s))
        reference = runs[splits[0]][0]["tokens"]
        for s, samples in runs.items():
            row = {
                "prompt_len": prompt_len,
                "max_splits": s,
                "us_per_step": statistics.median(sample["us_per_step"] for sample in samples),
                "samples_us": [sample["us_per_step"] for sample in samples],
                "tokens_equal": all(sample["tokens"] == reference for sample in samples),
            }
            result["rows"].append(row)
            print(row, flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
