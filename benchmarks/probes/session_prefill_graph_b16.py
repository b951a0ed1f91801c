"""Issue 29: a B=16 ``DecodeSession``'s generate as ``bench_generate`` times it, its prefill eager or from a graph.

``bench_generate``'s ``kernels_session`` row times whole generates on the host clock: a reset, the prefill of 16 x 512
tokens, 255 replayed decode steps and one read of the text. Its decode step (1262.6 µs at 1568d69) is longer than the
``DecodeSession`` probes' (``probes/session_*_b16.py``: 1246.9 µs, back-to-back replays after 31 warm-up steps, entry
86), and the GPU waits on the host through the prefill's first layer (2.8 ms, entry 84). This probe times both in one
process, on ``DecodeSession``s with ``fuse_projections`` and ``layer_kernels``:

- ``eager``: the generate as the bench ran it before entry 87's change, on a ``DecodeSession`` with
  ``capture_prefill=False``;
- ``graph``: the same on a second ``DecodeSession``, whose prefill replays a CUDA graph (``capture_prefill``, the
  default since entry 87: the shape's second prefill captures it). At a264aa1, before ``capture_prefill``, this probe
  captured ``session.prefill`` itself on one ``DecodeSession``.

Each generate records CUDA events at its start, after the prefill and after the decode steps, and the host clock around
it; the two variants alternate, ``--rounds`` times each, and after each round each ``DecodeSession``'s steps are timed
as the ``DecodeSession`` probes time them (``harness.ms_per_call_repeated``, 5 x ``--replays`` replays). Tokens: each
variant's are compared with the first eager generate's.

    python benchmarks/probes/session_prefill_graph_b16.py --out x.json
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

from flashcore.integrations.decode_session import DecodeSession  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--replays", type=int, default=40)
    args = parser.parse_args()
    device = torch.device("cuda")
    model, input_ids = harness.bench_model_and_prompts(16, device)
    max_cache_len = input_ids.shape[1] + args.new_tokens
    steps = args.new_tokens - 1

    with torch.inference_mode():
        sessions = {
            kind: DecodeSession(
                model, max_cache_len=max_cache_len, batch_size=16, fuse_projections=True, layer_kernels=True,
                capture_prefill=kind == "graph",
            )
            for kind in ("eager", "graph")
        }  # fmt: skip

        def generate(kind: str, num_steps: int) -> dict:
            session = sessions[kind]
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            torch.cuda.synchronize()
            started = time.perf_counter()
            events[0].record()
            session.reset()
            session.prefill(input_ids)
            events[1].record()
            for _ in range(num_steps):
                session.decode_step()
            events[2].record()
            text = torch.stack(session.text())
            torch.cuda.synchronize()
            host_ms = 1e3 * (time.perf_counter() - started)
            return {
                "host_ms": host_ms,
                "prefill_ms": events[0].elapsed_time(events[1]),
                "step_us": 1e3 * events[1].elapsed_time(events[2]) / max(num_steps, 1),
                "tokens": text[:, input_ids.shape[1] :].tolist(),
            }

        for kind in ("eager", "graph", "graph"):  # warm-up: kernels, the decode step's capture, the prefill's
            generate(kind, steps)
        assert ("prefill", *input_ids.shape) in sessions["graph"].captured_steps
        reference = generate("eager", steps)["tokens"]
        runs = {"eager": [], "graph": [], "eager_prefill_only": [], "graph_prefill_only": []}
        replays = []
        for round_index in range(args.rounds):
            order = ("eager", "graph") if round_index % 2 == 0 else ("graph", "eager")
            for kind in order:
                runs[kind].append(generate(kind, steps))
                runs[f"{kind}_prefill_only"].append(generate(kind, 0))
            session = sessions["eager"]
            session.reset()
            session.prefill(input_ids)
            for _ in range(31):
                session.decode_step()
            timings = harness.ms_per_call_repeated(session.decode_step, args.replays, 5)
            replays.append(1e3 * statistics.median(timings))
            print(round_index, {k: round(v[-1]["host_ms"], 2) for k, v in runs.items()}, round(replays[-1], 1))

    def summary(samples: list[dict]) -> dict:
        out = {key: statistics.median(s[key] for s in samples) for key in ("host_ms", "prefill_ms", "step_us")}
        out["samples_host_ms"] = [round(s["host_ms"], 3) for s in samples]
        out["samples_step_us"] = [round(s["step_us"], 2) for s in samples]
        out["tokens_equal_to_eager"] = all(
            s["tokens"] == [row[: len(s["tokens"][0])] for row in reference] for s in samples
        )
        return out

    rows = {kind: summary(samples) for kind, samples in runs.items()}
    for kind in ("eager", "graph"):
        # bench_generate's decomposition: (generate - 1-token generate) / 255
        whole, one = rows[kind]["host_ms"], rows[f"{kind}_prefill_only"]["host_ms"]
        rows[kind]["bench_step_us"] = 1e3 * (whole - one) / steps
        rows[kind]["tok_per_s"] = 16 * args.new_tokens / (whole * 1e-3)
    result = {
        "environment": harness.environment(device),
        "settings": vars(args),
        "rows": rows,
        "replayed_step_us_by_round": replays,
    }
    print(json.dumps(rows, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
