"""Probe: one decode step of the real SmolLM2 on the CPU, stock transformers against flashcore, by cache layout.

bench_cpu.py measures whole ``generate`` calls; this probe times bare decode forwards (``model(input_ids=[[t]],
cache=...)``, one torch thread, the thread's CPU time) after one shared-length prefill, to split flashcore's gap:

- ``stock``: sdpa attention, ``DynamicCache`` (``torch.cat`` of the whole prefix per layer per step);
- ``flashcore_interleaved``: ``FlashCoreCache`` with ``allocate_kv_cache``'s heads-interleaved K/V
  (``[B, S_max, H_kv, D]`` storage), what the CPU path used up to this probe;
- ``flashcore_contiguous``: the same cache's K/V copied to contiguous ``[B, H_kv, S_max, D]`` storage.

Steps are interleaved across the three in rounds; medians over ``--steps`` rounds. Also prints a cProfile of the
flashcore steps (top functions by own time).

    python benchmarks/probes/cpu_decode_step.py --context 3000 --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402
from bench_cpu import load_model  # noqa: E402

from flashcore.integrations.llama import CACHE_ARGUMENT_NAME, FlashCoreCache, apply_flashcore_to_llama  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    stock_model = load_model()
    import copy

    flash_model = apply_flashcore_to_llama(copy.deepcopy(stock_model))
    prompt = torch.randint(
        0, stock_model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0)
    )
    token = torch.tensor([[7]])
    from transformers import DynamicCache

    caches = {"stock": DynamicCache(config=stock_model.config)}
    flash_cache = FlashCoreCache(flash_model.config, max_cache_len=args.context + args.steps + 4)
    with torch.inference_mode():
        stock_model(input_ids=prompt, **{CACHE_ARGUMENT_NAME: caches["stock"]}, use_cache=True)
        flash_model(input_ids=prompt, **{CACHE_ARGUMENT_NAME: flash_cache}, use_cache=True)
    contiguous = copy.deepcopy(flash_cache)
    for layer in contiguous.layers:
        layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
    caches["flashcore_interleaved"], caches["flashcore_contiguous"] = flash_cache, contiguous
    models = {"stock": stock_model, "flashcore_interleaved": flash_model, "flashcore_contiguous": flash_model}
    times: dict[str, list[float]] = {name: [] for name in caches}
    position = torch.tensor([[args.context]])
    with torch.inference_mode():
        for step in range(args.steps):
            for name, cache in caches.items():
                start = time.thread_time()
                models[name](input_ids=token, position_ids=position + step, use_cache=True,
                             **{CACHE_ARGUMENT_NAME: cache})  # fmt: skip
                times[name].append(time.thread_time() - start)
        profiler = cProfile.Profile()
        profiler.enable()
        for step in range(4):
            flash_model(input_ids=token, position_ids=position + args.steps + step, use_cache=True,
                        **{CACHE_ARGUMENT_NAME: contiguous})  # fmt: skip
        profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(15)
    result = {
        "commit": harness.git_commit(),
        "context": args.context,
        "torch_threads": torch.get_num_threads(),
        "median_step_cpu_ms": {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()},
        "profile_flashcore_contiguous_4_steps": stream.getvalue(),
    }
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("profile")}, indent=2))
    print(stream.getvalue()[:3000])
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cpu_decode_step_{args.context}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
