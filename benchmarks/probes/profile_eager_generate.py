"""Where does the host time of an eager ``generate`` decode step go, stock transformers against flashcore?

Issue 25: flashcore's eager ``generate`` (compile disabled) should be no slower than stock transformers' eager
``generate`` (sdpa + DynamicCache) at B=1 and B=16; on the H100 it was 22.3 against 11.8 ms per step at B=1, and
host-bound. This probe runs both side by side on one random-weight model and reports, per side and batch size:

- ms per decode step: the median (and quartiles) of the gaps between consecutive decode steps, read by a stopping
  criterion that generate calls once per step (generate already syncs once per step to test for finished rows, so
  no sync is added). The sides alternate call by call, so that a drift of the (shared) host's speed reaches both;
- a cProfile of the decode steps only (enabled by that criterion after the prefill), top ``--top`` functions by
  tottime, in ms per step, flashcore's own functions (``flashcore/``, ``integrations/``) by cumtime, and their total
  tottime;
- with ``--trace``, torch.profiler's view of the decode steps: the aten ops dispatched per step, most frequent
  first, and on CUDA the device's busy time per step (kernel time summed: near the step time, the step is
  device-bound, not host-bound), the kernels launched and the host syncs and copies per step.

``--stub-kernel`` replaces flashcore's attention kernels with a stub (a zero output, ``seq_lens`` advanced): what
is left of flashcore's step is the integration's and the op's own work.

Model: Llama-3.2-1B's shape on CUDA (hidden 2048, 16 layers, 32/8 heads of 64, intermediate 8192, vocab 128256),
bf16; a small one on the CPU (16 layers of hidden 128, so that Python per layer dominates), fp32. Prompts are
unpadded random ids with an all-ones attention mask (``--left-pad`` pads all rows but the first by a quarter of the
prompt).

    python benchmarks/probes/profile_eager_generate.py --device cuda --trace --out /tmp/probe.json
    python benchmarks/probes/profile_eager_generate.py --device cpu --out /tmp/probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import platform
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SIDES = ("stock", "flashcore")
# "llama-3.2-1b" is bench_generate's model (benchmarks/bench_generate.py, build_config); "small" keeps its depth and
# head layout at tiny widths, so that on the CPU the step is mostly Python.
SMALL = dict(
    hidden_size=128,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=256,
    vocab_size=1024,
)
CONFIGS = ("llama-3.2-1b", "small")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="where the model runs")
    parser.add_argument(
        "--config", choices=tuple(CONFIGS), help="model shape (default: llama-3.2-1b on cuda, small on cpu)"
    )
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated B values")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens per row (default: 512 on cuda, 64 on cpu)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (N)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls per side, alternating sides")
    parser.add_argument("--backend", default="auto", help="flashcore backend: auto, triton or torch")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated sides to run: stock, flashcore")
    parser.add_argument("--left-pad", action="store_true", help="left-pad every row but the first")
    parser.add_argument("--top", type=int, default=25, help="profile rows kept per side")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also run torch.profiler: aten ops per step; on CUDA, device busy time, kernels and syncs per step",
    )
    parser.add_argument(
        "--stub-kernel",
        action="store_true",
        help="flashcore's attention kernel only allocates its output and advances seq_lens (tokens become garbage): "
        "the profile then shows the integration's and the op's own host time, without the kernel's",
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    return parser.parse_args()


def build_model(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    name = args.config or ("llama-3.2-1b" if args.device == "cuda" else "small")
    if name == "llama-3.2-1b":
        sys.path.insert(0, str(REPO / "benchmarks"))
        from bench_generate import build_config

        config = build_config(is_tiny=False)
    else:
        config = LlamaConfig(**SMALL, pad_token_id=0, eos_token_id=None)  # random weights: never stop early
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.disable_compile = True
    return name, model


def make_inputs(batch: int, prompt_len: int, vocab: int, left_pad: bool, device: str):
    generator = torch.Generator().manual_seed(batch)
    input_ids = torch.randint(3, vocab, (batch, prompt_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if left_pad:
        attention_mask[1:, : prompt_len // 4] = 0
        input_ids[attention_mask == 0] = 0
    return input_ids.to(device), attention_mask.to(device)


class StepClock:
    """A stopping criterion that never stops: records when each step ends (wall clock, and the calling thread's CPU
    time, which a busy shared host does not inflate), and starts ``on_first`` after the prefill (generate calls
    criteria once per new token, the first time right after the prefill's token)."""

    def __init__(self, on_first=None) -> None:
        self.times: list[tuple[float, float]] = []
        self.on_first = on_first

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append((time.perf_counter(), time.thread_time()))
        if len(self.times) == 1 and self.on_first is not None:
            self.on_first()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step_ms(self, clock: int = 0) -> list[float]:
        """Per decode step: wall ms (``clock=0``) or the thread's CPU ms (``clock=1``)."""
        return [(b[clock] - a[clock]) * 1e3 for a, b in zip(self.times[:-1], self.times[1:], strict=True)]


def generate(model, inputs, new_tokens: int, clock: StepClock):
    from transformers import StoppingCriteriaList

    input_ids, attention_mask = inputs
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        disable_compile=True,
        stopping_criteria=StoppingCriteriaList([clock]),
    )


def is_own_code(filename: str) -> bool:
    return filename.startswith(str(REPO / "flashcore")) or filename.startswith(str(REPO / "integrations"))


def profile_decode(model, inputs, new_tokens: int, top: int) -> dict:
    profiler = cProfile.Profile()
    clock = StepClock(on_first=profiler.enable)
    generate(model, inputs, new_tokens, clock)
    profiler.disable()
    steps = new_tokens - 1
    stats = pstats.Stats(profiler)
    rows, own_rows = [], []
    for (filename, line, function), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        row = {
            "function": f"{Path(filename).name}:{line}({function})",
            "calls_per_step": round(ncalls / steps, 2),
            "tottime_ms_per_step": round(tottime * 1e3 / steps, 4),
            "cumtime_ms_per_step": round(cumtime * 1e3 / steps, 4),
        }
        rows.append(row)
        if is_own_code(filename):
            own_rows.append(row)
    rows.sort(key=lambda row: row["tottime_ms_per_step"], reverse=True)
    own_rows.sort(key=lambda row: row["cumtime_ms_per_step"], reverse=True)
    return {
        "profiled_ms_per_step": round(sum(row["tottime_ms_per_step"] for row in rows), 3),
        "flashcore_python_ms_per_step": round(sum(row["tottime_ms_per_step"] for row in own_rows), 3),
        "top_by_tottime": rows[:top],
        # flashcore's own functions (flashcore/, integrations/) by cumulative time: where its layers spend theirs.
        "flashcore_by_cumtime": own_rows[:top],
    }


def trace_decode(model, inputs, new_tokens: int, top: int) -> dict:
    """torch.profiler over the decode steps: aten ops dispatched, and on CUDA the device's busy time, the kernels
    launched and the host syncs and copies, per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if inputs[0].is_cuda else [])
    profiler = profile(activities=activities)
    clock = StepClock(on_first=profiler.__enter__)
    generate(model, inputs, new_tokens, clock)
    profiler.__exit__(None, None, None)
    steps = new_tokens - 1
    events = profiler.key_averages()
    # Counting every aten op over-counts composite ones (their callees count too): a ranking, not a launch count.
    aten = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: e.count, reverse=True)
    result = {
        "aten_ops_per_step": round(sum(e.count for e in aten) / steps, 1),
        "top_aten_ops": [{"op": e.key, "calls_per_step": round(e.count / steps, 2)} for e in aten[:top]],
    }
    if inputs[0].is_cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
        syncs = [e for e in events if "Synchronize" in e.key or "Memcpy" in e.key or e.key == "aten::item"]
        result.update(
            gpu_busy_ms_per_step=round(sum(e.self_device_time_total for e in kernels) / 1e3 / steps, 3),
            gpu_kernels_per_step=round(sum(e.count for e in kernels) / steps, 1),
            syncs_and_copies_per_step={e.key: round(e.count / steps, 2) for e in syncs},
            top_gpu_kernels=[
                {
                    "kernel": e.key[:120],
                    "calls_per_step": round(e.count / steps, 2),
                    "us_per_step": round(e.self_device_time_total / steps, 2),
                }
                for e in kernels[:top]
            ],
        )
    return result


@contextlib.contextmanager
def patched(model, side: str, backend: str):
    """The model as ``side`` runs it: stock, or with flashcore applied (and removed on exit)."""
    from flashcore.integrations.llama import apply_flashcore_to_llama, remove_flashcore

    if side == "flashcore":
        apply_flashcore_to_llama(model, backend=backend)
    try:
        yield model
    finally:
        remove_flashcore(model)


def measure(model, inputs, args: argparse.Namespace) -> list[dict]:
    """The sides' decode steps, interleaved call by call, then each side's profiles."""
    sides = args.sides.split(",")
    step_ms = {side: [] for side in sides}
    cpu_ms = {side: [] for side in sides}
    for side in sides:
        with patched(model, side, args.backend):
            generate(model, inputs, 4, StepClock())  # warm-up: kernels, allocator, autotuning
    for _ in range(args.repeats):
        for side in sides:
            with patched(model, side, args.backend):
                clock = StepClock()
                generate(model, inputs, args.new_tokens, clock)
                step_ms[side] += clock.step_ms()
                cpu_ms[side] += clock.step_ms(clock=1)
    rows = []
    for side in sides:
        quartiles = statistics.quantiles(step_ms[side], n=4)
        row = {
            "side": side,
            "batch": inputs[0].shape[0],
            "ms_per_step": round(statistics.median(step_ms[side]), 3),
            "ms_per_step_p25_p75": [round(quartiles[0], 3), round(quartiles[2], 3)],
            "ms_per_step_min": round(min(step_ms[side]), 3),
            # CPU time of the thread that runs generate; on CUDA it includes spin-waits in syncs.
            "thread_cpu_ms_per_step": round(statistics.median(cpu_ms[side]), 3),
            "steps_timed": len(step_ms[side]),
        }
        with patched(model, side, args.backend):
            row.update(profile_decode(model, inputs, args.new_tokens, args.top))
            if args.trace:
                row.update(trace_decode(model, inputs, args.new_tokens, args.top))
        rows.append(row)
    return rows


class _StubKernel:
    """Stands in for every attention kernel: a zero output and the advance of ``seq_lens``."""

    NAME = "stub"

    @staticmethod
    def run(call):
        n_new = call.query_lens if call.query_lens is not None else call.query.shape[2]
        call.seq_lens.add_(n_new)
        return call.query.new_zeros(call.query.shape)  # not empty: garbage may hold denormals, slow on CPUs


def stub_attention_kernel() -> None:
    import flashcore.kernels

    flashcore.kernels.select_kernel = lambda call, backend: _StubKernel


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@torch.no_grad()
def main(args: argparse.Namespace) -> None:
    import transformers

    name, model = build_model(args)
    if args.stub_kernel:
        stub_attention_kernel()
    prompt_len = args.prompt_len or (512 if args.device == "cuda" else 64)
    rows = []
    for batch in (int(value) for value in args.batch_sizes.split(",")):
        inputs = make_inputs(batch, prompt_len, model.config.vocab_size, args.left_pad, args.device)
        for row in measure(model, inputs, args):
            rows.append(row)
            low, high = row["ms_per_step_p25_p75"]
            print(
                f"B={batch:<3} {row['side']:<9} {row['ms_per_step']:8.3f} ms/step (p25-p75 {low:.3f}-{high:.3f}), "
                f"thread CPU {row['thread_cpu_ms_per_step']:.3f} ms/step; flashcore's own Python "
                f"{row['flashcore_python_ms_per_step']:.3f} ms/step under cProfile"
            )
    result = {
        "question": "host time per eager generate decode step, stock transformers vs flashcore",
        "config": name,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "dtype": str(next(model.parameters()).dtype),
        "prompt_len": prompt_len,
        "new_tokens": args.new_tokens,
        "left_pad": args.left_pad,
        "backend": args.backend,
        "stub_kernel": args.stub_kernel,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": git_commit(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(parse_args())
