"""Issue 29: where a B=16 session's prefill of 16 x 512 tokens goes.

``bench_generate`` counts the prefill in tok/s: at d7f1654 it took 38.0 ms of the B=16 session's 399 ms, where its
projections' 15.9 TFLOP take about 20 ms at 790 TFLOP/s (entry 65). This probe builds ``bench_generate``'s model
(bf16, the Llama-3.2-1B shape), a ``DecodeSession`` with ``fuse_projections`` and ``layer_kernels`` (no compile,
``max_cache_len`` 768) and 16 random 512-token prompts, runs the prefill twice to warm up, then:

- times ``--repeats`` prefills on the host clock, each after ``reset()`` and a sync, to the sync after it (ms);
- profiles one more under torch.profiler (CPU and CUDA activity): the span of its kernels (first start to last
  end), the time the GPU runs none of them inside that span, the host time from the call to its last kernel's end,
  and per category (``decode_step_kernels.category``) the kernels' count and summed duration, with the
  projections' TFLOP/s over their GEMMs' time; the 15 kernels with the most summed time; and the 12 largest gaps
  in which the GPU runs none of the prefill's kernels, each with the kernels before and after it; and what the host
  does before the first projection's GEMM starts (its top-level events, and its calls that wait for the GPU).

``--rotary-heads N`` sets ``layer_kernels.ROTARY_HEADS_PER_PROGRAM`` (1: the RoPE's one-head programs of before
entry 66).

    python benchmarks/probes/session_prefill_kernels_b16.py --out session_prefill_kernels_b16.json
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_step_kernels  # noqa: E402
import harness  # noqa: E402

from flashcore.integrations.decode_session import DecodeSession  # noqa: E402
from flashcore.kernels.triton import layer_kernels  # noqa: E402


def timed_prefill(session: DecodeSession, input_ids: torch.Tensor) -> float:
    session.reset()
    torch.cuda.synchronize()
    started = time.perf_counter()
    session.prefill(input_ids)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - started)


def profile_prefill(session: DecodeSession, input_ids: torch.Tensor, flop: float) -> dict:
    from torch.profiler import ProfilerActivity, profile

    session.reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        called = time.perf_counter()
        session.prefill(input_ids)
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    start, end = kernels[0].time_range.start, max(k.time_range.end for k in kernels)
    busy, covered_to, gaps = 0.0, start, []
    for index, kernel in enumerate(kernels):  # the union of the kernels' intervals
        if kernel.time_range.start > covered_to and index > 0:
            gaps.append((kernel.time_range.start - covered_to, index))
        lo, hi = max(kernel.time_range.start, covered_to), kernel.time_range.end
        if hi > lo:
            busy += hi - lo
            covered_to = hi
    largest_gaps = [
        {
            "us": gap,
            "at_us": kernels[index].time_range.start - start,
            "kernel_index": index,
            "before": kernels[index - 1].name[:80],
            "after": kernels[index].name[:80],
        }
        for gap, index in sorted(gaps, reverse=True)[:12]
    ]
    by_category: dict[str, dict] = {}
    by_name: dict[str, float] = {}
    for kernel in kernels:
        duration, name = kernel.time_range.end - kernel.time_range.start, kernel.name[:100]
        row = by_category.setdefault(decode_step_kernels.category(kernel.name), {"count": 0, "us": 0.0})
        row["count"] += 1
        row["us"] += duration
        by_name[name] = by_name.get(name, 0.0) + duration
    gemm_us = by_category.get("gemv/gemm", {}).get("us", 0.0)
    # What the host does before the first projection's GEMM starts: the top-level host events in start order, and
    # every CUDA runtime call among them that waits for the GPU.
    first_gemm = next(k for k in kernels if decode_step_kernels.category(k.name) == "gemv/gemm")
    host = sorted(
        (
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CPU and e.time_range.start < first_gemm.time_range.start
        ),
        key=lambda e: e.time_range.start,
    )
    host0 = host[0].time_range.start if host else 0.0
    host_before_first_gemm = {
        "first_gemm_at_us_after_first_host_event": first_gemm.time_range.start - host0,
        "top_level": [
            {"name": e.name[:70], "at_us": e.time_range.start - host0, "us": e.time_range.end - e.time_range.start}
            for e in host
            if e.cpu_parent is None
        ],
        "waits": [
            {"name": e.name[:70], "at_us": e.time_range.start - host0, "us": e.time_range.end - e.time_range.start}
            for e in host
            if "Synchronize" in e.name or "Memcpy" in e.name or "item" in e.name or "local_scalar" in e.name
        ],
    }
    return {
        "kernels": len(kernels),
        "span_us": end - start,
        "idle_us_in_span": end - start - busy,
        "host_call_to_sync_ms": 1e3 * (time.perf_counter() - called),
        "by_category": by_category,
        "projection_tflop": flop / 1e12,
        "projection_tflops_over_gemm_time": flop / (gemm_us * 1e-6) / 1e12 if gemm_us else None,
        "top_kernels_us": sorted(by_name.items(), key=lambda item: -item[1])[:15],
        "largest_gaps": largest_gaps,
        "host_before_first_gemm": host_before_first_gemm,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rotary-heads", type=int, default=None, help="the RoPE's heads per program, at most")
    args = parser.parse_args()
    if args.rotary_heads is not None:
        layer_kernels.ROTARY_HEADS_PER_PROGRAM = args.rotary_heads
    device = torch.device("cuda")
    model, input_ids = harness.bench_model_and_prompts(16, device)
    head = model.get_output_embeddings().weight.numel()
    layer_weights = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)
    flop = 2 * layer_weights * input_ids.numel() + 2 * head * input_ids.shape[0]  # the LM head: last tokens only
    with torch.inference_mode():
        session = DecodeSession(model, max_cache_len=768, batch_size=16, fuse_projections=True, layer_kernels=True)
        for _ in range(2):
            timed_prefill(session, input_ids)
        times = [timed_prefill(session, input_ids) for _ in range(args.repeats)]
        profiled = profile_prefill(session, input_ids, flop)
    result = {
        "environment": harness.environment(device),
        "settings": vars(args),
        "prefill_ms": statistics.median(times),
        "prefill_ms_all": [round(t, 3) for t in times],
        "profile": profiled,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
