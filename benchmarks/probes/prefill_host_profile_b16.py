"""Issue 29: where the host's time goes in a B=16 session's prefill (cProfile).

Entry 84's timeline has the GPU waiting on the host through the first layer of a 16 x 512-token prefill: the host
takes about 1.1 ms before the first layer and about 1.1 ms in the first layer's attention module, while the GPU runs
its share of them in far less. This probe builds ``bench_generate``'s model (bf16, the Llama-3.2-1B shape), a
``DecodeSession`` with ``fuse_projections`` and ``layer_kernels`` (no compile, ``max_cache_len`` 768) and 16 random
512-token prompts, warms up with three prefills, then runs ``--repeats`` prefills under cProfile (each after
``reset()`` and a sync, the sync outside the profile) and reports the functions with the most own time and the most
cumulative time, per prefill. cProfile's own cost inflates every figure; the ranking is what this probe is for.

    python benchmarks/probes/prefill_host_profile_b16.py --out prefill_host_profile_b16.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.integrations.decode_session import DecodeSession  # noqa: E402


def top(stats: pstats.Stats, key: int, count: int, repeats: int) -> list[dict]:
    rows = []
    for (filename, line, name), (calls, _, own, cumulative, _) in stats.stats.items():
        where = f"{Path(filename).name}:{line} {name}"
        rows.append((own if key == 2 else cumulative, where, calls, own, cumulative))
    rows.sort(reverse=True)
    return [
        {
            "function": where,
            "calls": calls // repeats,
            "own_ms": 1e3 * own / repeats,
            "cumulative_ms": 1e3 * cum / repeats,
        }
        for _, where, calls, own, cum in rows[:count]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    device = torch.device("cuda")
    model, input_ids = harness.bench_model_and_prompts(16, device)
    profiler = cProfile.Profile()
    with torch.inference_mode():
        session = DecodeSession(model, max_cache_len=768, batch_size=16, fuse_projections=True, layer_kernels=True)
        for _ in range(3):
            session.reset()
            session.prefill(input_ids)
        for _ in range(args.repeats):
            session.reset()
            torch.cuda.synchronize()
            profiler.enable()
            session.prefill(input_ids)
            profiler.disable()
            torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    result = {
        "environment": harness.environment(device),
        "settings": vars(args),
        "total_ms_per_prefill": 1e3 * stats.total_tt / args.repeats,
        "by_own_time": top(stats, 2, args.top, args.repeats),
        "by_cumulative_time": top(stats, 3, args.top, args.repeats),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
