"""Probe: where does a whole eager ``generate`` spend the time that the median decode step does not show?

``bench_generate`` times whole generates (prompt 512, 256 new tokens) and put flashcore's eager path at B 1 below
stock's (18.8 against 16.5 ms per step on the H100 at d9eb76c), while ``profile_eager_generate``, which takes the
median of the step gaps, put them level. A median hides a tail: steps that stall now and then (a garbage
collection, an allocator call that frees to the driver, a host sync). This probe runs generate exactly as
``bench_generate`` does (its model, prompts and ``FlashCoreCache`` reused with ``reset()``, ``disable_compile=True``),
the two sides alternating generate by generate, and records per generate:

- the wall time of the whole call, the sum of its decode-step gaps, their median and the time in steps slower than
  twice the median ("tail");
- the three sides: stock, flashcore with a ``FlashCoreCache`` passed in and reused (as ``bench_generate``), and
  flashcore building its own per generate (as ``profile_eager_generate``);
- the garbage collector's runs by generation and their total time (``gc.callbacks``).

With ``--gc-freeze`` the objects alive after the warm-up are moved to the permanent generation (``gc.freeze()``),
so that a full collection no longer walks the loaded model's Python objects.

    python benchmarks/probes/eager_generate_tail.py --out DIR [--batches 1,16] [--repeats 6] [--gc-freeze]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_generate import build_config, build_model  # noqa: E402

SIDES = ("stock", "flashcore", "flashcore_own_cache")


class GcClock:
    """Counts the collector's runs per generation and sums their duration."""

    def __init__(self):
        self.started = None
        self.runs = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]

    def __call__(self, phase, info):
        if phase == "start":
            self.started = time.perf_counter()
        elif self.started is not None:
            self.runs[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self.started
            self.started = None


class StepClock:
    """A stopping criterion that never stops and stamps the wall clock once per generated token."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_generate(model, ids, cache, new_tokens: int) -> dict:
    from transformers import StoppingCriteriaList

    from flashcore.integrations.llama import CACHE_ARGUMENT_NAME

    kwargs = {} if cache is None else {CACHE_ARGUMENT_NAME: cache}
    if cache is not None:
        cache.reset()
    clock, gc_clock = StepClock(), GcClock()
    gc.callbacks.append(gc_clock)
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        disable_compile=True,
        stopping_criteria=StoppingCriteriaList([clock]),
        **kwargs,
    )
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    gc.callbacks.remove(gc_clock)
    gaps = [1e3 * (b - a) for a, b in zip(clock.times[:-1], clock.times[1:], strict=True)]
    median = statistics.median(gaps)
    return {
        "wall_ms": 1e3 * wall,
        "prefill_ms": 1e3 * (clock.times[0] - started),
        "steps_ms": sum(gaps),
        "step_median_ms": median,
        "tail_ms": sum(gap - median for gap in gaps if gap > 2 * median),
        "slow_steps": sum(gap > 2 * median for gap in gaps),
        "gc_runs": gc_clock.runs,
        "gc_ms": [1e3 * s for s in gc_clock.seconds],
    }


def main(args: argparse.Namespace) -> None:
    from flashcore.integrations.llama import FlashCoreCache, apply_flashcore_to_llama

    device = torch.device("cuda")
    config = build_config(is_tiny=False)
    stock = build_model(config, device)
    patched = apply_flashcore_to_llama(copy.deepcopy(stock))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        generator = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=generator).to(device)
        cache = FlashCoreCache(
            config, args.prompt_len + args.new_tokens, max_batch_size=batch, device=device, dtype=torch.bfloat16
        )
        # "flashcore" passes a FlashCoreCache reused across generates, as bench_generate does; "flashcore_own_cache"
        # lets the integration build one per generate, as profile_eager_generate does.
        models = {"stock": (stock, None), "flashcore": (patched, cache), "flashcore_own_cache": (patched, None)}
        for side in SIDES:  # warm-up
            run_generate(models[side][0], ids, models[side][1], args.new_tokens)
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        samples = {side: [] for side in SIDES}
        for rep in range(args.repeats):
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                model, side_cache = models[side]
                samples[side].append(run_generate(model, ids, side_cache, args.new_tokens))
        for side in SIDES:
            runs = samples[side]
            row = {"side": side, "batch": batch, "gc_freeze": args.gc_freeze, "samples": runs}
            for key in ("wall_ms", "steps_ms", "step_median_ms", "tail_ms", "slow_steps"):
                row[key] = round(statistics.median(run[key] for run in runs), 3)
            row["gc_ms_per_generate"] = [round(statistics.median(run["gc_ms"][g] for run in runs), 3) for g in range(3)]
            row["gc_runs_per_generate"] = [statistics.median(run["gc_runs"][g] for run in runs) for g in range(3)]
            rows.append(row)
            print(
                f"B={batch:<3} {side:19s} wall {row['wall_ms']:8.1f} ms, steps {row['steps_ms']:8.1f} ms, step median "
                f"{row['step_median_ms']:.3f} ms, tail {row['tail_ms']:.1f} ms in {row['slow_steps']} steps, gc "
                f"{row['gc_ms_per_generate']} ms in {row['gc_runs_per_generate']} runs (gen 0/1/2)",
                flush=True,
            )
    payload = {
        "question": __doc__.split("\n\n")[0],
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "git_commit": os.environ.get("FLASHCORE_GIT_COMMIT", "unknown"),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "eager_generate_tail" + ("_gc_freeze" if args.gc_freeze else "") + ".json"
    (out / name).write_text(json.dumps(payload, indent=1))
    print("wrote", out / name)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the JSON")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=6, help="timed generates per side, alternating")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
