"""Probe: what the HTTP layer of ``flashcore serve`` costs per streamed token, against the engine in process.

One :class:`~flashcore.engine.Engine` over ``--model``: ``smollm2``, the bundled SmolLM2-135M-Instruct (float32, the
CPU's torch backend), or ``random-1b`` on CUDA, ``bench_generate``'s random-weight Llama-3.2-1B-shaped bf16 model
(with the engine's defaults there: CUDA graphs, fused projections, layer kernels), whose tokenizer writes each token
id as the text ``<id>``. The same greedy request (a fixed prompt, sent as token ids, ``--tokens`` new tokens, EOS
ignored) runs, alternately, in process (token times taken in the engine's output callback) and through the server's
app (uvicorn on 127.0.0.1 in this process, the client reading ``POST /v1/completions`` with ``stream: true`` through
httpx, token times taken as each SSE event arrives). The inter-token gaps of each run are pooled per side; the
difference of the medians is the HTTP layer's cost per token (SSE framing, JSON, the event loop and the socket), on
top of a decode step that does not change.

    python benchmarks/probes/http_overhead.py --out DIR                                  # CPU, SmolLM2
    python benchmarks/probes/http_overhead.py --model random-1b --tokens 256 --out DIR   # a GPU
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class IdsAsTextTokenizer:
    """For random weights: a token id is the text ``<id>``, so every streamed token is a non-empty delta."""

    eos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __len__(self) -> int:  # the server checks token-id prompts against it
        return self.vocab_size

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"<{token}>" for token in ids)

    def encode(self, text: str) -> list[int]:
        return [int(part) for part in text.replace("<", " ").replace(">", " ").split()]


def load(name: str):
    """``(engine, prompt_ids)`` for ``--model``."""
    import torch

    from flashcore.engine import Engine

    if name == "smollm2":
        from flashcore.integrations.models import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(None, device="cpu", dtype="float32")
        engine = Engine(model, tokenizer, max_batch_size=2, max_cache_len=512, backend="torch")
        return engine, tokenizer.encode("Write a long story about a lighthouse keeper.")
    from bench_generate import build_config, build_model

    tiny = name == "random-tiny"
    config = build_config(tiny)
    model = build_model(config, torch.device("cpu" if tiny else "cuda"))
    tokenizer = IdsAsTextTokenizer(config.vocab_size)
    engine = Engine(model, tokenizer, max_batch_size=2, max_cache_len=1024)
    engine.warm_up()
    generator = torch.Generator().manual_seed(0)
    return engine, torch.randint(1, config.vocab_size, (32 if tiny else 512,), generator=generator).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (fixed: the host's noise stays small)")
    parser.add_argument(
        "--model",
        choices=["smollm2", "random-1b", "random-tiny"],
        default="smollm2",
        help="random-tiny: bench_generate's tiny config on the CPU, to check the script only",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import httpx
    import torch
    import uvicorn

    from flashcore.engine import SamplingParams
    from flashcore.integrations.llama import flashcore_options
    from flashcore.serve.app import build_app

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    engine, prompt_ids = load(args.model)

    def in_process() -> list[float]:
        times, done = [], threading.Event()

        def on_output(output):
            times.extend([time.perf_counter()] * len(output.token_ids))
            if output.finished:
                done.set()

        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        engine.submit(prompt_ids, params, on_output=on_output)
        done.wait()
        return times

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name="m"), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)

    def over_http() -> list[float]:
        body = {"model": "m", "prompt": prompt_ids, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        times = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
        return times

    gaps: dict[str, list[float]] = {"in_process": [], "http": []}
    over_http()  # warm-up
    for _ in range(args.rounds):
        for name, run in (("in_process", in_process), ("http", over_http)):
            times = run()
            gaps[name] += [b - a for a, b in zip(times[1:], times[2:], strict=False)]  # from the 2nd token on
    server.should_exit = True
    medians = {name: statistics.median(values) * 1e3 for name, values in gaps.items()}
    result = {
        "commit": harness.git_commit(),
        "model": args.model,
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "engine_model_options": flashcore_options(engine.model),
        "use_cuda_graph": engine.use_cuda_graph,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "itl_median_ms": {name: round(value, 3) for name, value in medians.items()},
        "http_cost_per_token_ms": round(medians["http"] - medians["in_process"], 3),
        "gaps_counted": {name: len(values) for name, values in gaps.items()},
    }
    print(json.dumps(result, indent=2))
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    name = "http_overhead.json" if args.model == "smollm2" else f"http_overhead_{args.model}.json"
    (out / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
