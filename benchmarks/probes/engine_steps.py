"""Probe: where an engine step's time goes, on ``bench_serve``'s model and anchor workload.

Runs the anchor workload (64 requests at once, prompts 128-1024, 128 new tokens) through ``Engine.step`` on the
calling thread, twice (the first run compiles kernels and captures graphs), and for the second run records each
step's wall time (synchronised), its kind (packed/mixed or decode-only), its token count and the padded width of
its packed layout. Then, at 64 running decode rows, splits a decode step into the graph replay alone and the rest
of ``step()`` (host bookkeeping, buffer copies, selection and the one host read). A torch.profiler table of one
mixed step's CUDA kernels is written too.

    python benchmarks/probes/engine_steps.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402
from bench_generate import build_config, build_model  # noqa: E402
from bench_serve import NullTokenizer, workload  # noqa: E402

from flashcore.engine import Engine, SamplingParams  # noqa: E402


def timed_steps(engine: Engine, requests) -> list[dict]:
    for request in requests:
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True)
        engine.submit(request["prompt"], params)
    steps = []
    while engine.has_work():
        running = [row for row in engine.rows if row.request is not None]
        prefilling = sum(row.request.is_prefilling for row in running)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        steps.append({"ms": (time.perf_counter() - start) * 1e3, "running": len(running), "prefilling": prefilling})
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    args = parser.parse_args()
    device = torch.device("cuda")
    config = build_config(False)
    model = build_model(config, device)
    requests = workload(1, 64, (128, 1024), (128, 128), config.vocab_size, rate=None)

    def new_engine():
        return Engine(model, NullTokenizer(), max_batch_size=64, max_cache_len=2568, max_num_tokens=args.max_num_tokens)

    timed_steps(new_engine(), requests)
    steps = timed_steps(new_engine(), requests)
    mixed = [s for s in steps if s["prefilling"]]
    decode = [s for s in steps if not s["prefilling"]]
    result = {
        "commit": harness.git_commit(),
        "environment": harness.environment(device),
        "max_num_tokens": args.max_num_tokens,
        "total_ms": round(sum(s["ms"] for s in steps), 1),
        "mixed_steps": {"count": len(mixed), "total_ms": round(sum(s["ms"] for s in mixed), 1),
                        "median_ms": round(statistics.median(s["ms"] for s in mixed), 2) if mixed else None},
        "decode_steps": {"count": len(decode), "total_ms": round(sum(s["ms"] for s in decode), 1),
                         "median_ms": round(statistics.median(s["ms"] for s in decode), 3) if decode else None},
        "first_mixed_steps_ms": [round(s["ms"], 1) for s in mixed[:8]],
    }  # fmt: skip

    # Decode at 64 running rows: the replay alone against the whole step.
    engine = new_engine()
    for request in requests:
        engine.submit(request["prompt"][:512], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    while any(row.request is None or row.request.is_prefilling for row in engine.rows):
        engine.step()
    for _ in range(3):
        engine.step()
    graph, _ = engine.runner.decode.graphs[64]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - start) / 20 * 1e3
    start = time.perf_counter()
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / 20 * 1e3
    result["decode_64"] = {"replay_ms": round(replay_ms, 3), "step_ms": round(step_ms, 3)}

    # One mixed step's kernels.
    engine = new_engine()
    for request in requests[:8]:
        engine.submit(request["prompt"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    print(table)
    result["mixed_step_top_kernels"] = table
    out = Path(args.out or "benchmarks/probes/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_steps.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("mixed_step_top_kernels", "environment")}, indent=2))


if __name__ == "__main__":
    main()
