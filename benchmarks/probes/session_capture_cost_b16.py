"""Issue 29: what a B=16 session's captures cost on the host: a full collection before each (before 1b812a7) against
the cycle collector paused through each (``backends.cycle_collector_paused``, from 1b812a7).

``bench_generate`` at 822acf0 found a session row's first timed generate, whose prefill is captured (the prompt
shape's second prefill, ``capture_prefill``), 0.56-0.67 s longer than the next ones. Here fresh sessions
(``fuse_projections``, ``layer_kernels``; ``bench_generate``'s model and 16 x 512-token prompts) alternate between
the two ways, each running three generates as the bench does (reset, prefill, 255 steps, the text): the first
captures the decode step, the second the prefill, the third replays both. Reported per session: the three
generates' seconds, and the second's and the first's excess over the third. Also the time of one ``gc.collect()``
in this process.

    python benchmarks/probes/session_capture_cost_b16.py --out x.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore import backends  # noqa: E402
from flashcore.integrations import decode_session  # noqa: E402


@contextlib.contextmanager
def collect_first():
    """What a capture did before 1b812a7."""
    gc.collect()
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sessions", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda")
    model, input_ids = harness.bench_model_and_prompts(16, device)
    rows = []
    with torch.inference_mode():
        for index in range(args.sessions):
            variant = "collect_first" if index % 2 == 0 else "paused"
            pause = collect_first if variant == "collect_first" else backends.cycle_collector_paused
            # every capture goes through backends.captured_graph (since 918a7c4), which calls this
            with mock.patch.object(backends, "cycle_collector_paused", pause):
                session = decode_session.DecodeSession(
                    model, max_cache_len=768, batch_size=16, fuse_projections=True, layer_kernels=True
                )
                seconds = []
                for _ in range(3):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    session.reset()
                    session.prefill(input_ids)
                    for _ in range(255):
                        session.decode_step()
                    session.text()
                    torch.cuda.synchronize()
                    seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
            gc.collect()
            collect_s = time.perf_counter() - started
            row = {
                "session": index,
                "variant": variant,
                "generates_s": [round(s, 4) for s in seconds],
                "prefill_capture_excess_s": round(seconds[1] - seconds[2], 4),
                "first_generate_excess_s": round(seconds[0] - seconds[2], 4),
                "gc_collect_s_after": round(collect_s, 4),
                "gc_objects": len(gc.get_objects()),
            }
            rows.append(row)
            print(row, flush=True)
            del session
    result = {"environment": harness.environment(device), "settings": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
