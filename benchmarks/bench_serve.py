"""Serving: flashcore's engine against transformers' own continuous batching, on one GPU, in one run.

The model is ``bench_generate``'s random-weight Llama-3.2-1B-shaped bf16 model (random weights: EOS is ignored,
every request generates exactly its ``max_tokens``). Workloads, all with fixed seeds:

- ``anchor``: 64 requests at once, prompts uniform in [128, 1024] tokens, 128 new tokens each. Side by side:
  ``flashcore_engine`` (in process), ``hf_generate_batch`` (transformers' ``generate_batch``: its continuous
  batching with paged attention) and ``hf_static_waves`` (HF ``generate`` with a static cache in waves of 16,
  left-padded, eager: ``disable_compile=True``, since a compiled wave recompiles for each wave's length).
- ``poisson``: requests with Poisson arrivals at each ``--rates`` (req/s), prompts uniform in [128, 2048], outputs
  uniform in [64, 512]. ``flashcore_engine`` (background thread, requests submitted at their arrival times) and
  ``hf_continuous`` (``init_continuous_batching``'s manager, requests added at their arrival times), each rate
  for both unless the time budget says otherwise.
- ``decode_64``: the engine's decode-only step with 64 running rows at 1024 tokens of context (CUDA-graph
  replay), and the bandwidth it reaches: (weight bytes + KV bytes read) / step time, as a share of a
  device-memory copy measured at the run's start.
- ``lone``: one request (prompt 512, 256 new tokens): the engine's median inter-token latency against
  ``DecodeSession``'s decode step on the same model.

The engine runs with its defaults (on CUDA: ``fuse_projections`` and ``layer_kernels`` on); ``--engine-options``
changes them, and the JSON records what the engine ran (``settings.engine_model_options``).

Per row: output tok/s (output tokens / time from first arrival to last token), time to first token (TTFT) and
inter-token latency (ITL: gaps between a request's consecutive tokens) p50/p99, where the system streams them
(``generate_batch`` and static waves return whole requests: TTFT and ITL are not reported for them).

    python benchmarks/bench_serve.py --out DIR          # ~5 min on an H100
    python benchmarks/bench_serve.py --dry-run --out /tmp/x   # tiny model on the CPU: checks the script only
"""

from __future__ import annotations

import argparse
import copy
import random
import threading
import time

import harness
import torch
from bench_generate import build_config, build_model

from flashcore.engine import Engine, SamplingParams
from flashcore.integrations.llama import flashcore_options


class NullTokenizer:
    """Random weights have no text: outputs are token ids; the engine asks the tokenizer for text and EOS."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def workload(seed: int, count: int, prompt_range, output_range, vocab: int, rate: float | None):
    rng = random.Random(seed)
    requests, clock = [], 0.0
    for _ in range(count):
        if rate:
            clock += rng.expovariate(rate)
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_range))]
        requests.append({"prompt": prompt, "max_tokens": rng.randint(*output_range), "arrival": clock})
    return requests


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_ms": round(pick(0.5) * 1e3, 2), "p99_ms": round(pick(0.99) * 1e3, 2)}


def summarize(requests, token_times: dict[int, list[float]], start: float, end: float) -> dict:
    tokens = sum(len(times) for times in token_times.values())
    ttft = [token_times[i][0] - (start + r["arrival"]) for i, r in enumerate(requests) if token_times.get(i)]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:], strict=False)]
    return {
        "requests": len(requests),
        "output_tokens": tokens,
        "seconds": round(end - start, 3),
        "output_tok_per_s": round(tokens / (end - start), 1),
        "ttft": percentiles(ttft),
        "itl": percentiles(itl),
    }


def run_engine(engine: Engine, requests, sync) -> dict:
    """Submits each request at its arrival time to the engine's background thread; times every token."""
    token_times: dict[int, list[float]] = {i: [] for i in range(len(requests))}
    done = threading.Semaphore(0)

    def on_output(index):
        def callback(output):
            now = time.perf_counter()
            token_times[index].extend([now] * len(output.token_ids))
            if output.finished:
                done.release()

        return callback

    engine.start()
    start = time.perf_counter()
    for index, request in enumerate(requests):
        delay = start + request["arrival"] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True)
        engine.submit(request["prompt"], params, on_output=on_output(index))
    for _ in requests:
        done.acquire()
    end = time.perf_counter()
    engine.shutdown()
    sync()
    return summarize(requests, token_times, start, end)


def run_hf_continuous(model, requests, sync) -> dict:
    """transformers' ContinuousBatchingManager, requests added at their arrival times with ``streaming=True``, so
    that each request's partial outputs time its tokens as the engine's callbacks do."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(r["max_tokens"] for r in requests), do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    token_times: dict[int, list[float]] = {i: [] for i in range(len(requests))}
    finished = set()
    start = time.perf_counter()
    for index, request in enumerate(requests):
        delay = start + request["arrival"] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        manager.add_request(request["prompt"], request_id=f"r{index}", max_new_tokens=request["max_tokens"],
                            streaming=True)  # fmt: skip
        _drain_hf(manager, token_times, finished, timeout=0)
    while len(finished) < len(requests):
        _drain_hf(manager, token_times, finished, timeout=1)
    end = time.perf_counter()
    manager.stop(block=True)
    sync()
    return summarize(requests, token_times, start, end)


def _is_finished(result) -> bool:
    is_finished = getattr(result, "is_finished", None)  # a method from transformers 5.2x; the status field before
    return is_finished() if callable(is_finished) else str(result.status).endswith("FINISHED")


def _drain_hf(manager, token_times, finished, timeout: float) -> None:
    """Reads the manager's outputs: each holds a request's tokens so far, so new ones are timed now."""
    while True:
        result = manager.get_result(timeout=timeout or 0.0001)
        if result is None:
            return
        index = int(result.request_id[1:])
        now = time.perf_counter()
        token_times[index].extend([now] * (len(result.generated_tokens) - len(token_times[index])))
        if _is_finished(result):
            finished.add(index)
        timeout = 0


def run_generate_batch(model, requests, sync) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=requests[0]["max_tokens"], do_sample=False, eos_token_id=-1)
    prompts = [r["prompt"] for r in requests]
    model.generate_batch(inputs=prompts[:4], generation_config=config)  # warm-up
    sync()
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
    sync()
    end = time.perf_counter()
    tokens = sum(len(out.generated_tokens) for out in outputs.values())
    return {"requests": len(requests), "output_tokens": tokens, "seconds": round(end - start, 3),
            "output_tok_per_s": round(tokens / (end - start), 1)}  # fmt: skip


def run_static_waves(model, requests, device, sync, wave: int = 16) -> dict:
    new_tokens = requests[0]["max_tokens"]
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(requests), wave):
        prompts = [r["prompt"] for r in requests[first : first + wave]]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, cache_implementation="static", disable_compile=True,
        )  # fmt: skip
        tokens += (out.shape[1] - width) * len(prompts)
    sync()
    end = time.perf_counter()
    return {"requests": len(requests), "output_tokens": tokens, "seconds": round(end - start, 3),
            "output_tok_per_s": round(tokens / (end - start), 1)}  # fmt: skip


def decode_bandwidth(
    engine: Engine, config, weight_bytes: int, rows: int, context: int, sync, copy_tb_per_s: float | None
) -> dict:
    """Fills ``rows`` rows with ``context``-token prompts, then times decode-only steps (graph replays). The
    bandwidth is a share of ``copy_tb_per_s``, the device-memory copy measured at the run's start (none on the CPU)."""
    rng = random.Random(7)
    params = SamplingParams(max_tokens=min(100, engine.max_cache_len - context), temperature=0, ignore_eos=True)
    for _ in range(rows):
        engine.submit([rng.randrange(1, config.vocab_size) for _ in range(context)], params)
    while engine.stats()["waiting"] or any(row.request and row.request.is_prefilling for row in engine.rows):
        engine.step()
    for _ in range(3):
        engine.step()  # captures the bucket
    sync()
    steps = 20
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_s = (time.perf_counter() - start) / steps
    kv_bytes = 2 * rows * config.num_key_value_heads * (context + 12) * config.head_dim * 2 * config.num_hidden_layers
    engine.shutdown()
    return {
        "rows": rows,
        "context": context,
        "step_ms": round(step_s * 1e3, 3),
        "tok_per_s": round(rows / step_s, 1),
        "bytes_per_step": weight_bytes + kv_bytes,
        "bandwidth_util_pct": (
            round(100 * (weight_bytes + kv_bytes) / step_s / (copy_tb_per_s * 1e12), 1) if copy_tb_per_s else None
        ),
    }


def lone_request(engine: Engine, model, config, device, sync, prompt_len: int, new_tokens: int) -> dict:
    from flashcore.integrations.decode_session import DecodeSession

    rng = random.Random(8)
    prompt = [rng.randrange(1, config.vocab_size) for _ in range(prompt_len)]
    request = {"prompt": prompt, "max_tokens": new_tokens, "arrival": 0.0}
    run_engine(engine, [request], sync)  # warm-up: captures bucket 1
    engine_row = run_engine(engine, [request], sync)
    session = DecodeSession(model, max_cache_len=prompt_len + new_tokens + 8)
    session.prefill(torch.tensor([prompt], device=device))
    for _ in range(3):
        session.decode_step()
    sync()
    start = time.perf_counter()
    for _ in range(new_tokens - 4):
        session.decode_step()
    sync()
    session_ms = (time.perf_counter() - start) / (new_tokens - 4) * 1e3
    return {
        "engine_itl": engine_row["itl"],
        "session_step_ms": round(session_ms, 3),
        "ratio_p50": round(engine_row["itl"]["p50_ms"] / session_ms, 3),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="result folder (default: $OUT, else benchmarks/results)")
    parser.add_argument("--rates", default="8,32", help="Poisson arrival rates, requests per second")
    parser.add_argument("--poisson-requests", type=int, default=256)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-num-tokens", type=int, default=2048, help="the engine's token budget per step")
    parser.add_argument("--sections", default="anchor,poisson,decode_64,lone")
    parser.add_argument("--hf-poisson-requests", type=int, default=64, help="requests for hf_continuous (slow)")
    parser.add_argument("--time-budget-s", type=float, default=540.0)
    parser.add_argument(
        "--engine-options",
        default="",
        help="comma-separated Engine options, NAME (on) or NAME=off, of fuse_projections and layer_kernels (default: "
        "the Engine's, both on with CUDA)",
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU: checks the script only")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.sections = args.sections.split(",")
    return args


def parse_engine_options(text: str) -> dict[str, bool]:
    """``"fuse_projections,layer_kernels=off"`` → ``{"fuse_projections": True, "layer_kernels": False}``."""
    options = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in ("fuse_projections", "layer_kernels") or value not in ("", "on", "off"):
            raise SystemExit(f"--engine-options: got {item!r}; name fuse_projections or layer_kernels, =on or =off")
        options[name] = value != "off"
    return options


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    device, payload, json_path, _ = harness.start_run("bench_serve", args)
    payload["ceilings"] = harness.measure_copy_tb_per_s(device) if device.type == "cuda" else {}
    config = build_config(args.dry_run)
    model = build_model(config, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine_model = copy.deepcopy(model)
    engine_options = parse_engine_options(args.engine_options)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    scale = 16 if args.dry_run else 1
    max_cache_len = 2048 + 512 + 8

    def new_engine(rows=args.max_batch_size):
        """A fresh engine (no conversation from an earlier run to reuse), its graphs captured before the clock."""
        engine = Engine(engine_model, NullTokenizer(), max_batch_size=rows, max_cache_len=max_cache_len // scale,
                        max_queue=1024, max_num_tokens=max(args.max_num_tokens // scale, rows),
                        **engine_options)  # fmt: skip
        engine.warm_up()
        payload["settings"]["engine_model_options"] = flashcore_options(engine.model)  # what the engine ran
        return engine

    def record(row: dict, body) -> None:
        harness.log(f"[{row['workload']} {row['system']}]  (t={time.perf_counter() - started:.0f}s)")
        if time.perf_counter() > started + args.time_budget_s:
            row.update(status="skipped", reason="time budget spent")
        else:
            harness.run_guarded(row, body)
            harness.log(f"  { ({k: v for k, v in row.items() if k not in ('workload', 'system')}) }")
        payload["rows"].append(row)
        harness.write_json(json_path, payload)

    vocab = config.vocab_size
    if "anchor" in args.sections:
        anchor = workload(1, 64, (128 // scale, 1024 // scale), (128 // scale,) * 2, vocab, rate=None)

        def anchor_engine(row):
            # Warm-up on other prompts of the same lengths: the Triton kernels compile for this run's shapes.
            warm = workload(9, 64, (128 // scale, 1024 // scale), (8,) * 2, vocab, rate=None)
            run_engine(new_engine(), warm, sync)
            row.update(run_engine(new_engine(), anchor, sync))

        record({"workload": "anchor", "system": "flashcore_engine"}, anchor_engine)
        record({"workload": "anchor", "system": "hf_generate_batch"},
               lambda row: row.update(run_generate_batch(model, anchor, sync)))  # fmt: skip
        record({"workload": "anchor", "system": "hf_static_waves"},
               lambda row: row.update(run_static_waves(model, anchor, device, sync)))  # fmt: skip
    if "poisson" in args.sections:
        count = args.poisson_requests // (8 if args.dry_run else 1)
        for rate in args.rates:
            requests = workload(2, count, (128 // scale, 2048 // scale), (64 // scale, 512 // scale), vocab, rate)
            record({"workload": f"poisson_{rate:g}", "system": "flashcore_engine"},
                   lambda row, r=requests: row.update(run_engine(new_engine(), r, sync)))  # fmt: skip
            hf_requests = requests[: args.hf_poisson_requests]
            record({"workload": f"poisson_{rate:g}_first{len(hf_requests)}", "system": "hf_continuous"},
                   lambda row, r=hf_requests: row.update(run_hf_continuous(model, r, sync)))  # fmt: skip
            record({"workload": f"poisson_{rate:g}_first{len(hf_requests)}", "system": "flashcore_engine"},
                   lambda row, r=hf_requests: row.update(run_engine(new_engine(), r, sync)))  # fmt: skip
    if "decode_64" in args.sections:
        rows, context = min(64, args.max_batch_size), 1024 // scale

        def decode_64(row):
            copy_tb_per_s = payload["ceilings"].get("copy_tb_per_s")
            row.update(decode_bandwidth(new_engine(rows), config, weight_bytes, rows, context, sync, copy_tb_per_s))

        record({"workload": "decode_64", "system": "flashcore_engine"}, decode_64)
    if "lone" in args.sections:

        def lone(row):
            row.update(lone_request(new_engine(), engine_model, config, device, sync, 512 // scale, 256 // scale))

        record({"workload": "lone", "system": "flashcore_engine"}, lone)
    harness.finish_run(payload, json_path, started)
    for row in payload["rows"]:
        harness.log(f"{row['workload']:>22} {row['system']:>18}: {row.get('output_tok_per_s', '')} tok/s "
                    f"ttft {row.get('ttft', '')} itl {row.get('itl', '')} {row.get('status')}")  # fmt: skip
    return payload


if __name__ == "__main__":
    main()
