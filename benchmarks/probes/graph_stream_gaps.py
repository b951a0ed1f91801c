"""Issue 29: does a CUDA graph's chain of small kernels replay with longer gaps on one stream than on another?

``probes/session_placement_b16.py`` found a B=16 ``DecodeSession``'s replayed step about 70 µs slower (every kernel
the same length, the gaps between them 0.35 µs longer) when the ``DecodeSession`` runs on a stream of its own instead
of the default stream, and on the default stream from the fourth ``DecodeSession`` of a process on when its warm-up
steps were each followed by a copy. This probe takes the model out: ``--kernels`` launches of one small Triton
kernel (a 16 x 2048 bf16 add, each reading the last one's output), with or without programmatic dependent launch
(PDL), captured as one graph, then timed replaying on the default stream and on a new stream, alternating,
``--rounds`` times; µs per replay (CUDA events around ``--replays`` back-to-back replays) and per kernel.

    python benchmarks/probes/graph_stream_gaps.py --out graph_stream_gaps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402


@triton.jit
def _add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, x + 1, mask=offs < n)


def capture(kernels: int, use_pdl: bool) -> torch.cuda.CUDAGraph:
    buffers = [torch.zeros(16 * 2048, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    n, block = buffers[0].numel(), 1024

    def chain():
        for index in range(kernels):
            x, out = buffers[index % 2], buffers[(index + 1) % 2]
            _add_one[(triton.cdiv(n, block),)](x, out, n, BLOCK=block, USE_PDL=use_pdl, launch_pdl=use_pdl)

    chain()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    graph.buffers = buffers  # keep them alive with the graph
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kernels", type=int, default=200)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    rows = []
    for use_pdl in (True, False):
        graph = capture(args.kernels, use_pdl)
        timings: dict[str, list[float]] = {"default": [], "side": []}
        for _ in range(args.rounds):
            for name, stream in (("default", torch.cuda.current_stream()), ("side", side)):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    timings[name] += harness.ms_per_call_repeated(graph.replay, args.replays, 1)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
        for name, values in timings.items():
            us = 1e3 * statistics.median(values)
            rows.append(
                {"pdl": use_pdl, "stream": name, "us_per_replay": us, "us_per_kernel": us / args.kernels,
                 "us_all": [round(1e3 * v, 2) for v in values]}
            )  # fmt: skip
            print(rows[-1], flush=True)
    result = {"environment": harness.environment(torch.device("cuda")), "settings": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
