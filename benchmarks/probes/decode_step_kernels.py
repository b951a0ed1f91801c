"""Every kernel of one graph-replayed ``DecodeSession`` decode step, with its duration and the gap before it.

Issue 29 asks where a B=1 decode step's time goes beyond streaming the weights. This probe builds
``bench_generate``'s random-weight Llama-3.2-1B-shaped model (bf16), prefills a 512-token prompt, warms up and
captures the step, then runs ``--steps`` replays under torch.profiler (CUDA activity) and reads the kernels back in
start order. The replays are cut into steps by kernel count (every replay launches the same kernels), and the
median step is reported kernel by kernel: name, duration, the idle gap before it (from the previous kernel's end),
and the category it falls in (GEMV/GEMM, attention, norm, RoPE, elementwise, argmax, other), and its *advance*: how far
its end moves the latest end of the kernels before it. Under programmatic dependent launch a kernel starts while
the one before it drains and waits inside (``gdc_wait``), so its duration counts time the two share; the advances
add up to the step's span, each kernel's share of it. Per variant:

- ``session``: ``DecodeSession(model)`` (the eager modules, replayed);
- ``kernels``: ``fuse_projections=True, layer_kernels=True`` (one GEMM for q/k/v and gate/up; flashcore's
  RMSNorm, RoPE and SiLU-and-mul);
- ``fused_compiled``: ``compile=True, fuse_projections=True`` (bench_generate's fastest path until entry 54);
- ``kernels_compiled``: ``compile=True`` with both options (the fastest since entry 54, when a B=1 step's
  projections moved onto flashcore's GEMV).

Reported: kernels per step, the sum of kernel durations, the step's span (first kernel start to last kernel end),
the sum of gaps, duration and advance per category, and the weights' bytes over the span against 3.0 TB/s. And what
flashcore's GEMV compiled to in the process (``gemv_compilations``): per tiles and switches, registers a thread,
spills, and how many programs an SM holds by registers and warps.

    python benchmarks/probes/decode_step_kernels.py --out benchmarks/probes/results/decode_step_kernels.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
from bench_generate import build_config, build_model  # noqa: E402

VARIANTS = {
    "session": dict(),
    "kernels": dict(fuse_projections=True, layer_kernels=True),
    "fused_compiled": dict(compile=True, fuse_projections=True),
    "kernels_compiled": dict(compile=True, fuse_projections=True, layer_kernels=True),
}
CATEGORIES = (  # the first pattern a kernel's lower-cased name contains names its category
    ("attention", ("attention", "decode_kernel", "merge_kv", "warp_specialized")),
    ("gemv/gemm", ("gemv", "gemm", "rows_mlp", "cutlass", "sm90_xmma", "nvjet", "splitk", "matmul", "mm_")),
    ("norm", ("rms_norm", "norm")),
    ("rope", ("rotary", "rope")),
    ("argmax", ("argmax", "max", "reduce")),
    ("elementwise", ("elementwise", "triton_poi", "silu", "mul", "add", "copy", "fill", "index", "cat", "scatter")),
)


def category(name: str) -> str:
    lower = name.lower()
    for label, patterns in CATEGORIES:
        if any(pattern in lower for pattern in patterns):
            return label
    return "other"


def profile_variant(model, input_ids, options: dict, steps: int) -> dict:
    from flashcore.integrations.decode_session import DecodeSession

    session = DecodeSession(model, max_cache_len=2048, batch_size=input_ids.shape[0], **options)
    session.prefill(input_ids)
    for _ in range(8):  # eager warm-up (and compilation), capture, replays
        session.decode_step()
    return profile_session(session, steps)


def profile_session(session, steps: int) -> dict:
    """``steps`` replayed decode steps of a warmed-up ``session`` under torch.profiler, read back as above."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            session.decode_step()
        torch.cuda.synchronize()
    kernels = sorted(
        (event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda event: event.time_range.start,
    )
    kernels = [k for k in kernels if "memcpy" not in k.name.lower() and "memset" not in k.name.lower()]
    if len(kernels) % steps:
        raise RuntimeError(f"{len(kernels)} kernels over {steps} replays: replays launched different kernels")
    per_step = len(kernels) // steps
    step_rows = []
    for index in range(steps):
        step = kernels[index * per_step : (index + 1) * per_step]
        rows, previous_end = [], None
        for kernel in step:
            start, end = kernel.time_range.start, kernel.time_range.end  # µs
            gap = 0.0 if previous_end is None else max(0.0, start - previous_end)
            advance = end - start if previous_end is None else max(0.0, end - previous_end)
            row = {
                "name": kernel.name[:120],
                "category": category(kernel.name),
                "us": end - start,
                "gap_us": gap,
                "advance_us": advance,
            }
            rows.append(row)
            previous_end = max(end, previous_end or end)
        span = step[-1].time_range.end - step[0].time_range.start
        step_rows.append({"span_us": span, "rows": rows})
    median_span = statistics.median(step["span_us"] for step in step_rows)
    step = min(step_rows, key=lambda s: abs(s["span_us"] - median_span))  # the step nearest the median span
    by_category: dict[str, float] = {}
    advance_by_category: dict[str, float] = {}
    for row in step["rows"]:
        by_category[row["category"]] = by_category.get(row["category"], 0.0) + row["us"]
        advance_by_category[row["category"]] = advance_by_category.get(row["category"], 0.0) + row["advance_us"]
    return {
        "kernels_per_step": per_step,
        "span_us_median": median_span,
        "span_us_all": [round(s["span_us"], 1) for s in step_rows],
        "kernel_us_sum": sum(row["us"] for row in step["rows"]),
        "gap_us_sum": sum(row["gap_us"] for row in step["rows"]),
        "us_by_category": by_category,
        "advance_us_by_category": advance_by_category,
        "kernels_by_category": {c: sum(r["category"] == c for r in step["rows"]) for c in by_category},
        "median_step": step["rows"],
    }


def gemv_compilations() -> dict:
    """What flashcore's GEMV kernel compiled to in this process (Triton's JIT cache of ``gemv._gemv_kernel``, which
    every compile goes through): per compiled variant its switches and tiles, registers a thread and spills, and how
    many programs an SM holds by registers (64K a SM, allotted 8 a thread at a time) and by warps (64 a SM). Also
    how many launch signatures the direct launcher (``gemv._launch_gemv``) keeps."""
    from flashcore.kernels.triton import gemv

    kernel = gemv._gemv_kernel
    switches = ("BLOCK_N", "BLOCK_K", "NORM", "SWIGLU", "ROTARY", "HAS_RESIDUAL", "NEXT_TILE_FIRST")
    rows = []
    for device_cache in kernel.device_caches.values():
        for compiled in device_cache[0].values():
            constants = {
                kernel.arg_names[key[0]] if isinstance(key, tuple) else key: value
                for key, value in compiled.src.constants.items()
            }
            num_warps, registers = compiled.metadata.num_warps, compiled.n_regs
            allocated = -(-max(registers, 1) // 8) * 8
            rows.append({
                **{name: constants.get(name) for name in switches},
                "num_warps": num_warps,
                "maxnreg": getattr(compiled.metadata, "maxnreg", None),
                "registers": registers,
                "spills": compiled.n_spills,
                "programs_per_sm": min(65536 // (allocated * 32 * num_warps), 64 // num_warps),
            })  # fmt: skip
    return {"compiled": rows, "direct_launch_signatures": len(gemv._launch_gemv._compiled)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_step_kernels.py profiles CUDA kernels: it needs a CUDA GPU")
    device = torch.device("cuda")
    config = build_config(is_tiny=False)
    model = build_model(config, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, config.vocab_size, (args.batch, args.prompt_len), generator=generator).to(device)
    result = {"environment": harness.environment(device), "settings": vars(args), "weight_bytes": weight_bytes}
    result["variants"] = {}
    for name in args.variants.split(","):
        variant_model = copy.deepcopy(model) if VARIANTS[name] else model  # the options patch a model in place
        with torch.inference_mode():
            summary = profile_variant(variant_model, input_ids, VARIANTS[name], args.steps)
        summary["weights_pct_of_3tb_over_span"] = 100 * weight_bytes / (summary["span_us_median"] * 1e-6) / 3.0e12
        summary["gemv_compilations"] = gemv_compilations()
        result["variants"][name] = summary
        for row in summary["gemv_compilations"]["compiled"]:
            print("   gemv", row, flush=True)
        print(f"{name}: {summary['kernels_per_step']} kernels, span {summary['span_us_median']:.0f} us, kernels "
              f"{summary['kernel_us_sum']:.0f} us, gaps {summary['gap_us_sum']:.0f} us, "
              f"{summary['weights_pct_of_3tb_over_span']:.1f}% of 3 TB/s", flush=True)  # fmt: skip
        for label, us in sorted(summary["us_by_category"].items(), key=lambda item: -item[1]):
            count, advance = summary["kernels_by_category"][label], summary["advance_us_by_category"][label]
            print(f"   {label}: {us:.0f} us in {count} kernels, advance {advance:.0f} us", flush=True)
        if variant_model is not model:
            del variant_model
            torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
