"""Issue 29: where the host time of HF's compiled ``generate`` goes, per decode step, stock against flashcore.

``bench_generate`` at a452b0e puts a decode step of ``kernels_compiled`` (``apply_flashcore_to_llama`` with fused
projections and layer kernels, HF's automatic compile) at 2.237 ms at B=1 and 2.646 ms at B=16, where a session
replaying the same kernels takes 0.989 and 1.503 ms: about 1.2 ms a step is ``generate``'s host work, in series with
the device because ``generate`` syncs once a step to test for finished rows. ``stock_static_compiled``
(``cache_implementation="static"``) takes 3.48 and 4.97 ms. This probe runs both paths side by side on one
random-weight Llama-3.2-1B (``bench_generate``'s model, bf16) and reports, per path and batch size:

- ms per decode step: the median and quartiles of the gaps between consecutive calls of a stopping criterion (one
  per step; no sync added), the paths alternating call by call;
- a cProfile of the decode steps only, as ``profile_eager_generate.py`` takes it: the top functions by tottime and
  by cumtime, in ms per step, each with its main callers (cProfile's own overhead inflates them; compare the paths
  with each other).

    python benchmarks/probes/profile_compiled_generate.py --out x.json
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402
from profile_eager_generate import REPO, StepClock, make_inputs  # noqa: E402

PATHS = ("stock_static_compiled", "kernels_compiled")
CALLERS = 4  # callers kept per profiled function


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated B values")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls per path, alternating paths")
    parser.add_argument("--top", type=int, default=40, help="profile rows kept per path")
    parser.add_argument("--out", required=True, help="JSON file to write")
    return parser.parse_args()


class Paths:
    """The stock model and a flashcore copy of it (same weights); each path's generate."""

    def __init__(self, args: argparse.Namespace) -> None:
        from bench_generate import build_config
        from transformers import LlamaForCausalLM

        from flashcore.integrations.llama import apply_flashcore_to_llama

        self.args = args
        config = build_config(is_tiny=False)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device("cuda"):
            self.stock = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        self.flashcore = apply_flashcore_to_llama(copy.deepcopy(self.stock), fuse_projections=True, layer_kernels=True)
        self.caches: dict[int, object] = {}

    def cache(self, batch: int):
        """One FlashCoreCache per batch size, reset before each generate (as ``bench_generate`` does): the
        compiled step keeps its CUDA graph while the cache's tensors keep their addresses."""
        from flashcore.integrations.llama import FlashCoreCache

        if batch not in self.caches:
            self.caches[batch] = FlashCoreCache(
                self.flashcore.config,
                self.args.prompt_len + self.args.new_tokens,
                max_batch_size=batch,
                device="cuda",
                dtype=torch.bfloat16,
            )
        self.caches[batch].reset()
        return self.caches[batch]

    def generate(self, path: str, inputs, new_tokens: int, clock: StepClock):
        from transformers import StoppingCriteriaList

        from flashcore.integrations.llama import CACHE_ARGUMENT_NAME

        input_ids, attention_mask = inputs
        kwargs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
        if path == "stock_static_compiled":
            return self.stock.generate(**kwargs, cache_implementation="static")
        cache = self.cache(input_ids.shape[0])
        return self.flashcore.generate(**kwargs, **{CACHE_ARGUMENT_NAME: cache})


def _name(key: tuple) -> str:
    filename, line, function = key
    where = filename if filename.startswith("<") or filename == "~" else Path(filename).name
    if filename.startswith(str(REPO)):
        where = str(Path(filename).relative_to(REPO))
    return f"{where}:{line}({function})"


def profile_decode(paths: Paths, path: str, inputs, top: int) -> dict:
    steps = paths.args.new_tokens - 1
    profiler = cProfile.Profile()
    clock = StepClock(on_first=profiler.enable)
    paths.generate(path, inputs, paths.args.new_tokens, clock)
    profiler.disable()
    rows = []
    for key, (_, ncalls, tottime, cumtime, callers) in pstats.Stats(profiler).stats.items():
        callers = sorted(callers.items(), key=lambda item: item[1][3], reverse=True)[:CALLERS]
        rows.append(
            {
                "function": _name(key),
                "calls_per_step": round(ncalls / steps, 2),
                "tottime_ms_per_step": round(tottime * 1e3 / steps, 4),
                "cumtime_ms_per_step": round(cumtime * 1e3 / steps, 4),
                # Who called it, with the calls per step and the cumtime per step each gave it.
                "callers": [
                    [_name(caller), round(stat[0] / steps, 2), round(stat[3] * 1e3 / steps, 4)]
                    for caller, stat in callers
                ],
            }
        )
    by_cumtime = sorted(rows, key=lambda row: row["cumtime_ms_per_step"], reverse=True)
    rows.sort(key=lambda row: row["tottime_ms_per_step"], reverse=True)
    return {
        "profiled_ms_per_step": round(sum(row["tottime_ms_per_step"] for row in rows), 3),
        "top_by_tottime": rows[:top],
        "top_by_cumtime": by_cumtime[:top],
    }


@torch.no_grad()
def main(args: argparse.Namespace) -> None:
    import transformers

    paths = Paths(args)
    rows = []
    for batch in (int(value) for value in args.batch_sizes.split(",")):
        inputs = make_inputs(batch, args.prompt_len, paths.stock.config.vocab_size, False, "cuda")
        step_ms = {path: [] for path in PATHS}
        cpu_ms = {path: [] for path in PATHS}
        for path in PATHS:  # warm-up: compiles, CUDA graph captures, autotuning
            for _ in range(2):
                paths.generate(path, inputs, args.new_tokens, StepClock())
        for _ in range(args.repeats):
            for path in PATHS:
                clock = StepClock()
                paths.generate(path, inputs, args.new_tokens, clock)
                step_ms[path] += clock.step_ms()
                cpu_ms[path] += clock.step_ms(clock=1)
        for path in PATHS:
            quartiles = statistics.quantiles(step_ms[path], n=4)
            row = {
                "path": path,
                "batch": batch,
                "ms_per_step": round(statistics.median(step_ms[path]), 3),
                "ms_per_step_p25_p75": [round(quartiles[0], 3), round(quartiles[2], 3)],
                # CPU time of the thread that runs generate; it includes spin-waits in the step's sync.
                "thread_cpu_ms_per_step": round(statistics.median(cpu_ms[path]), 3),
                "steps_timed": len(step_ms[path]),
            }
            row.update(profile_decode(paths, path, inputs, args.top))
            rows.append(row)
            print(
                f"B={batch:<3} {path:<22} {row['ms_per_step']:7.3f} ms/step, thread CPU "
                f"{row['thread_cpu_ms_per_step']:.3f}, cProfile total {row['profiled_ms_per_step']:.3f} ms/step"
            )
    result = {
        "question": "host time per compiled generate decode step, stock transformers vs flashcore's layer kernels",
        "device": torch.cuda.get_device_name(),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": harness.git_commit(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    harness.write_json(Path(args.out), result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(parse_args())
