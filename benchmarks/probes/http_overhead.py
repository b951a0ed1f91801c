"""Probe: what the HTTP layer of ``flashcore serve`` costs per streamed token, against the engine in process.

The bundled SmolLM2-135M-Instruct (float32, the CPU's torch backend) in one :class:`~flashcore.engine.Engine`. The
same greedy request (a fixed prompt, ``--tokens`` new tokens, EOS ignored) runs, alternately, in process (token times
taken in the engine's output callback) and through the server's app (uvicorn on 127.0.0.1 in this process, the
client reading ``POST /v1/completions`` with ``stream: true`` through httpx, token times taken as each SSE event
arrives). The inter-token gaps of each run are pooled per side; the difference of the medians is the HTTP layer's
cost per token (SSE framing, JSON, the event loop and the socket), on top of a decode step that does not change.

    python benchmarks/probes/http_overhead.py --out DIR
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (fixed: the host's noise stays small)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import httpx
    import torch
    import uvicorn

    from flashcore.engine import Engine, SamplingParams
    from flashcore.integrations.models import load_model_and_tokenizer
    from flashcore.serve.app import build_app

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(None, device="cpu", dtype="float32")
    engine = Engine(model, tokenizer, max_batch_size=2, max_cache_len=512, backend="torch")
    prompt = "Write a long story about a lighthouse keeper."
    prompt_ids = tokenizer.encode(prompt)

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
        body = {"model": "m", "prompt": prompt, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True,
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
    (out / "http_overhead.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
