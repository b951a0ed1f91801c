"""How the benchmarks time a call and record a run: the timers, the ceilings, and the result file.

Every flashcore call appends to its cache and advances ``seq_lens`` in place, so it cannot be handed to
``triton.testing.do_bench`` as is: do_bench's warm-up and repeats (thousands of calls for a 10 µs kernel), and
do_bench_cudagraph's graph of thousands of unrolled calls, would time a cache that grows by thousands of tokens
and, with ``check=False``, runs past its capacity. :class:`CudaTimer` therefore repeats do_bench's method (flush
the 50 MB L2 through a 256 MB buffer, CUDA events around the call, median over many calls) and adds one step,
outside the events: ``reset()``, which puts ``seq_lens`` back, so every timed call sees exactly the same
cache. The stateless SDPA side is also timed with do_bench itself, as a check on this harness.

The flush *reads* the buffer by default. do_bench zeroes it, which leaves L2 full of dirty lines: their
write-back to HBM then happens inside the next timed call and is charged to it (``--l2-flush write`` keeps
do_bench's way, for comparison; benchmarks/NOTES.md has both).

The benchmark scripts import this file as a sibling module (``python benchmarks/bench_*.py`` puts
``benchmarks/`` on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

NOMINAL_TB_PER_S = 3.0  # H100 SXM HBM3, the ceiling issue 5 counts against (copy measured 3.02 TB/s)
NOMINAL_TFLOPS = 790.0  # H100 dense bf16 matmul as measured on the H100 test host (issue 5)
L2_FLUSH_BYTES = 256 * 1024 * 1024  # triton.testing.do_bench zeroes this much before each call
# The rotating input sets of a graph replay aim to add up to this, five times the H100's 50 MB L2, so one call's
# K/V is long evicted when the same set comes round again (at most MAX_ROTATION_SETS: B1 L1k gets 32 x 4.2 MB).
ROTATION_BYTES = 256 * 1024 * 1024
MAX_ROTATION_SETS = 32
# torch.cuda._sleep argument, in GPU clock cycles: ~25 ms at the H100's 1.98 GHz, longer than the host
# needs to issue the 128 calls of a host-time sample, so the device never stalls the host.
HOST_TIMING_SLEEP_CYCLES = 50_000_000
# Queued after each L2 flush, outside the events: ~250 us at 1.98 GHz, more than the host needs to issue the reset,
# the flush, the events and one eager call (40-80 us at decode sizes), so the call is always queued before its start
# event runs and the events time the device alone (benchmarks/NOTES.md, entry 28).
TIMED_CALL_LEAD_CYCLES = 500_000


def resolve_out_dir(out: str | None) -> Path:
    """``--out``, else ``$OUT`` (a GPU run's result folder), else ``benchmarks/results``."""
    path = Path(out or os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    path.mkdir(parents=True, exist_ok=True)
    return path


def git_commit() -> str:
    """$FLASHCORE_GIT_COMMIT if set, else HEAD (with "-dirty" if the tree has uncommitted or untracked files), else
    "unknown".

    A GPU host may receive a copy of the working tree whose .git is missing or stale (an older commit's),
    so whoever launches the run there passes the commit in FLASHCORE_GIT_COMMIT, and it wins."""
    if os.environ.get("FLASHCORE_GIT_COMMIT"):
        return os.environ["FLASHCORE_GIT_COMMIT"]
    fallback = "unknown"
    try:
        result = _git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return fallback
    commit = result.stdout.strip()
    if result.returncode != 0 or not commit:
        return fallback
    dirty = _git("status", "--porcelain").stdout.strip()
    return commit + ("-dirty" if dirty else "")


def _git(*args: str) -> subprocess.CompletedProcess:
    here = Path(__file__).resolve().parent
    return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)


def environment(device: torch.device) -> dict:
    """What the numbers were measured on: GPU, library versions, commit, date."""
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(device),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            cuda=torch.version.cuda,
            sm_count=props.multi_processor_count,
            gpu_memory_gb=round(props.total_memory / 1e9, 1),
            l2_cache_mb=round(getattr(props, "L2_cache_size", 0) / 1e6, 1),
        )
    else:
        info["gpu"] = None
    return info


def write_json(path: Path, payload: dict) -> None:
    """Atomic rewrite, so a run killed mid-write still leaves the previous complete file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    tmp.replace(path)


def log(message: str) -> None:
    print(message, flush=True)


def start_run(benchmark: str, args: argparse.Namespace, **sections) -> tuple[torch.device, dict, Path, Path]:
    """The device (the CPU for ``--dry-run``, else the CUDA GPU, or exit saying how to test the script without one),
    the run's payload (``sections`` go between its settings and its rows), and the paths of its JSON and PNG."""
    if args.dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit(f"{benchmark}.py needs a CUDA GPU (use --dry-run to test the script on the CPU)")
    else:
        device = torch.device("cuda")
    out_dir = resolve_out_dir(args.out)
    json_path, png_path = out_dir / f"{benchmark}.json", out_dir / f"{benchmark}.png"
    payload = {"benchmark": benchmark, "status": "running", "dry_run": args.dry_run}
    payload.update(environment=environment(device), settings=vars(args), **sections, rows=[])
    log(f"{benchmark}: {payload['environment'].get('gpu') or device}, results -> {json_path}")
    return device, payload, json_path, png_path


def finish_run(payload: dict, json_path: Path, started: float) -> None:
    """Marks the payload complete, with the run's wall time, and writes it."""
    payload["status"] = "complete"
    payload["wall_s"] = round(time.perf_counter() - started, 1)
    write_json(json_path, payload)


def draw_plot(plot_function: str, payload: dict, json_path: Path, png_path: Path) -> None:
    """``plot.<plot_function>(payload, png_path)``, a failure only logged: the JSON is the result, and plot.py can
    redraw the picture from it."""
    try:
        import plot

        getattr(plot, plot_function)(payload, png_path)
        log(f"wrote {json_path} and {png_path}")
    except Exception as error:  # noqa: BLE001  (see the docstring)
        log(f"wrote {json_path}; plot failed: {error!r}")


def run_guarded(row: dict, body: Callable[[dict], None]) -> dict:
    """Runs one row; an exception is recorded on the row (and printed) instead of ending the script."""
    started = time.perf_counter()
    try:
        body(row)
        row.setdefault("status", "ok")
    except Exception as error:  # noqa: BLE001  (one failing config must not stop the others)
        row["status"] = "error"
        row["error"] = f"{type(error).__name__}: {error}"[:2000]
        row["traceback"] = traceback.format_exc()[-4000:]
        log(f"  ERROR {row['error'][:300]}")
    finally:
        row["wall_s"] = round(time.perf_counter() - started, 2)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return row


def rotation_sets(bytes_per_set: int, max_sets: int = MAX_ROTATION_SETS) -> int:
    """How many input sets a graph replay cycles through: enough to add up to ROTATION_BYTES."""
    return max(1, min(max_sets, -(-ROTATION_BYTES // max(1, bytes_per_set))))


def compare(out: torch.Tensor, ref: torch.Tensor, *, atol: float, rtol: float) -> dict:
    """Max abs error, relative L2 error, and pass = finite and |out - ref| <= atol + rtol * |ref| everywhere."""
    out32, ref32 = out.float(), ref.float()
    diff = (out32 - ref32).abs()
    is_finite = bool(torch.isfinite(out32).all())
    max_abs = float(diff.max()) if diff.numel() else 0.0
    ref_norm = float(ref32.norm())
    rel_l2 = float((out32 - ref32).norm()) / ref_norm if ref_norm > 0 else float(max_abs > 0)
    within = bool((diff <= atol + rtol * ref32.abs()).all())
    return {"passed": is_finite and within, "max_abs_err": max_abs, "rel_l2_err": rel_l2, "finite": is_finite}


class CudaTimer:
    """do_bench's method plus a state reset outside the timed region (see the module docstring)."""

    def __init__(
        self, device: torch.device, *, eager_iters: int, graph_replays: int, host_samples: int, l2_flush: str = "read"
    ):
        if l2_flush not in ("read", "write"):
            raise ValueError(f"l2_flush must be 'read' or 'write', got {l2_flush!r}")
        self.device = device
        self.eager_iters = eager_iters
        self.graph_replays = graph_replays
        self.host_samples = host_samples
        self.l2_flush = l2_flush
        self._flush_buffer = torch.zeros(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
        self._flush_sink = torch.zeros((), dtype=torch.int32, device=device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def _before_timed_call(self, reset: Callable[[], None]) -> None:
        reset()
        if self.l2_flush == "read":
            torch.amax(self._flush_buffer, dim=0, out=self._flush_sink)
        else:
            self._flush_buffer.zero_()
        # The flush alone (~90 µs) was meant to keep the GPU busy while the host issues the timed call, but an
        # eager decode call takes the host 40-80 µs to issue, and with the reset before it the GPU sometimes
        # reached the start event first: host time then leaked into the device time (up to 24 µs between
        # repetitions, one row at 211.8 µs against 17-22; NOTES.md, entry 27). The sleep keeps the device behind
        # the host; host cost is measured separately (host_us).
        torch.cuda._sleep(TIMED_CALL_LEAD_CYCLES)

    def eager_us(self, call: Callable[[], object], reset: Callable[[], None], warmup: int = 3) -> float:
        """Median device time of one eager call, cold L2, state reset before each call."""
        for _ in range(warmup):
            reset()
            call()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.eager_iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.eager_iters)]
        for start, end in zip(starts, ends, strict=True):
            self._before_timed_call(reset)
            start.record()
            call()
            end.record()
        self.synchronize()
        reset()
        return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))

    def graph_us(
        self, calls: list[Callable[[], object]], reset: Callable[[], None]
    ) -> tuple[float, list[object], torch.cuda.CUDAGraph]:
        """Median device time per call under CUDA-graph replay, the graph's static outputs, and the graph.

        The outputs live in the graph's memory pool: keep the returned graph alive while reading them.

        One graph holds one call per rotating input set, so consecutive calls touch different memory; each
        replay is preceded (outside the events) by the reset and an L2 flush.
        """
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs advises
            for call in calls:
                reset()
                call()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.synchronize()
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = [call() for call in calls]
        self.synchronize()
        per_call_ms = []
        for _ in range(self.graph_replays):
            self._before_timed_call(reset)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            self.synchronize()
            per_call_ms.append(start.elapsed_time(end) / len(calls))
        # Leave the outputs of one replay from the reset state, for the caller to check.
        reset()
        graph.replay()
        self.synchronize()
        return 1e3 * statistics.median(per_call_ms), outputs, graph

    def host_us(self, sides: dict[str, list[Callable[[], object]]], reset: Callable[[], None], n_calls: int) -> dict:
        """Host time to issue one eager call (Python, validation, launch) per side, the device never the limit.

        A long ``torch.cuda._sleep`` kernel is queued first, so the ``n_calls`` calls issued after it only
        enqueue work (no queue is full, nothing waits on the device); perf_counter brackets the issuing. The
        sides' samples are interleaved, in alternating order, so that drift in the host's speed (a shared
        machine) lands on both sides alike rather than on whichever side ran second.
        """

        def sample(calls):
            reset()
            self.synchronize()
            torch.cuda._sleep(HOST_TIMING_SLEEP_CYCLES)
            started = time.perf_counter()
            for i in range(n_calls):
                calls[i % len(calls)]()
            elapsed = time.perf_counter() - started
            self.synchronize()
            return 1e6 * elapsed / n_calls

        return _interleaved_medians(sides, reset, sample, self.host_samples)


class CpuTimer:
    """Wall-clock stand-in used by ``--dry-run``: exercises every code path on a machine without a GPU."""

    def __init__(self, device: torch.device, *, eager_iters: int, graph_replays: int, host_samples: int, **_):
        self.device = device
        self.eager_iters = eager_iters
        self.host_samples = host_samples

    def synchronize(self) -> None:
        pass

    def eager_us(self, call, reset, warmup: int = 1) -> float:
        for _ in range(warmup):
            reset()
            call()
        samples = []
        for _ in range(self.eager_iters):
            reset()
            started = time.perf_counter()
            call()
            samples.append(1e6 * (time.perf_counter() - started))
        reset()
        return statistics.median(samples)

    def graph_us(self, calls, reset):
        return None, None, None

    def host_us(self, sides, reset, n_calls: int) -> dict:
        def sample(calls):
            reset()
            started = time.perf_counter()
            for i in range(n_calls):
                calls[i % len(calls)]()
            return 1e6 * (time.perf_counter() - started) / n_calls

        return _interleaved_medians(sides, reset, sample, self.host_samples)


def _interleaved_medians(sides: dict, reset: Callable[[], None], sample: Callable, n_samples: int) -> dict:
    """Median of ``n_samples`` samples per side, taken round-robin; every other round in reverse side order."""
    for calls in sides.values():  # allocator and launcher caches warm
        reset()
        for call in calls:
            call()
    samples = {name: [] for name in sides}
    for round_index in range(n_samples):
        names = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for name in names:
            samples[name].append(sample(sides[name]))
    reset()
    return {name: statistics.median(values) for name, values in samples.items()}


def ms_per_call_repeated(call: Callable[[], object], calls: int, trials: int) -> list[float]:
    """Each of ``trials`` timings of ``calls`` back-to-back calls of ``call``, in ms per call: CUDA events around them
    on a GPU (the device's time; the calls queue ahead of it), the wall clock on the CPU. For steps that carry their
    own state (a session's decode step, a graph replay), which the per-call timers above cannot reset."""
    timings = []
    for _ in range(trials):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                call()
            end.record()
            end.synchronize()
            timings.append(start.elapsed_time(end) / calls)
        else:
            started = time.perf_counter()
            for _ in range(calls):
                call()
            timings.append(1e3 * (time.perf_counter() - started) / calls)
    return timings


def gemv_whole_row_config(k: int) -> dict:
    """The one-row GEMV's whole-row tiles for K <= 4096 (``gemv_triton``'s ``config``): one K step over the whole row,
    with the warps to keep 64 fp32 accumulators a thread, and at 8 warps at most 128 registers a thread (two programs
    an SM). The GEMVs that compute the RMSNorm took them until entry 57, which measured the two-step tiles of
    ``gemv_config`` faster; the probes compare the two."""
    import triton

    if k > 4096:
        raise ValueError(f"the whole-row tiles cover K <= 4096, got K = {k}")
    block_k = triton.next_power_of_2(k)
    num_warps = min(16, max(4, block_k // 256))
    return dict(block_n=8, block_k=block_k, num_warps=num_warps, maxnreg=128 if num_warps == 8 else None)


# The session probes' shape: the session's capacity and the replays per timing. session_probe_main sets them from
# its --max-cache-len and --replays; a capacity of bench_generate's (prompt 512 + 256 new = 768) needs few replays,
# since the context grows by 5 x replays over the timings.
SESSION_SHAPE = {"max_cache_len": 2048, "replays": 100}


def session_steps(model, input_ids: torch.Tensor, **options) -> dict:
    """The session probes' measurement of one variant: a fresh ``DecodeSession(model, max_cache_len, **options)``
    (``SESSION_SHAPE``'s capacity, 2048 by default) over ``input_ids``' rows gives 32 greedy tokens (the prefill's,
    an eager warm-up step, the capture, replays), then 5 timings of ``SESSION_SHAPE["replays"]`` replayed steps (100
    by default: the context grows by 500 tokens over them). Returns ``{"us_per_step": the median timing, "tokens":
    row 0's tokens}``, a run for :func:`alternating_step_rounds`.

    The tokens are read once, from the session's text, after the warm-up steps. Before d7f1654 each step's token
    was cloned as it came, and on the H100 at B=16 sessions timed that way stepped about 70 µs slower from the fourth
    of a process on: each kernel as long, the gaps between them 0.35 µs longer. Without those copies every session
    stepped fast (NOTES.md, entries 63 and 64; not explained)."""
    from flashcore.integrations.decode_session import DecodeSession

    max_cache_len, replays = SESSION_SHAPE["max_cache_len"], SESSION_SHAPE["replays"]
    session = DecodeSession(model, max_cache_len=max_cache_len, batch_size=input_ids.shape[0], **options)
    session.prefill(input_ids)
    for _ in range(31):
        session.decode_step()
    tokens = session.text()[0][-32:].tolist()  # row 0's: the prefill's token and the 31 steps'
    timings = [1e3 * ms for ms in ms_per_call_repeated(session.decode_step, replays, 5)]
    return {"us_per_step": statistics.median(timings), "tokens": tokens}


@contextlib.contextmanager
def rows_gemm_config_replaced(shape: tuple[int, int] | None, overrides: dict, norm_only: bool = False):
    """While it runs, ``rows_gemm.rows_gemm_config`` answers for the weight shape ``shape`` (``(n, k)``; with
    ``norm_only``, only where the norm is folded in) its own configuration updated with ``overrides``: how the
    session probes try other tiles of the few-row GEMM while a session is built and captured. ``shape`` None
    replaces nothing."""
    from flashcore.kernels.triton import rows_gemm

    config = rows_gemm.rows_gemm_config

    def replaced(n: int, k: int, device, norm: bool = False, element_size: int = 2) -> dict:
        shipped = config(n, k, device, norm, element_size)
        return dict(shipped, **overrides) if (n, k) == shape and (norm or not norm_only) else shipped

    if shape is not None:
        rows_gemm.rows_gemm_config = replaced
    try:
        yield
    finally:
        rows_gemm.rows_gemm_config = config


QKV_SHAPE = (3072, 2048)  # bench_generate's model: the fused q/k/v weight, [N, K]


def qkv_config_probe_main(doc: str, variants: dict, report: dict | None = None) -> None:
    """The main of the B=16 probes that try options of the q/k/v projection's few-row GEMM (the norm and the RoPE
    inside): :func:`session_probe_main` over ``variants`` (name: ``(overrides,)``, a dict that updates
    ``rows_gemm_config``'s answer for ``QKV_SHAPE`` where the norm is folded in, or None for the shipped
    configuration), each session built and captured inside :func:`rows_gemm_config_replaced`; ``"shipped"`` is the
    reference; ``report`` as :func:`session_probe_main` takes it."""

    def timed_session(model, input_ids, overrides: dict | None) -> dict:
        with rows_gemm_config_replaced(QKV_SHAPE if overrides else None, overrides or {}, norm_only=True):
            return session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)

    session_probe_main(doc, variants, timed_session, reference="shipped", batch=16, report=report)


def bench_model_and_prompts(batch: int, device: torch.device, prompt_len: int = 512) -> tuple:
    """``bench_generate``'s model (the Llama-3.2-1B shape, random bf16 weights) on ``device`` and ``batch`` random
    prompts of ``prompt_len`` tokens (seed 0): ``(model, input_ids)``, what the B=1 and B=16 probes run on."""
    from bench_generate import build_config, build_model

    model = build_model(build_config(is_tiny=False), device)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=generator).to(device)
    return model, input_ids


def session_probe_main(
    doc: str,
    variants: dict,
    timed_session: Callable[..., dict],
    reference: str,
    batch: int = 1,
    report: dict | None = None,
) -> None:
    """The main of the session probes (``probes/session_*_b1.py``, ``_b16.py``): ``--out``, ``--rounds``,
    ``--variants``, ``--max-cache-len`` and ``--replays`` (``SESSION_SHAPE``), ``--batch`` (default ``batch``);
    ``bench_generate``'s model (the Llama-3.2-1B shape, bf16) and that many random 512-token prompts on the GPU;
    then ``timed_session(model, input_ids, *variants[name])`` for each variant, alternating over the rounds, and the
    rows of :func:`alternating_step_rounds` written as JSON, with ``report`` (a dict the probe fills as it runs)
    under ``"report"`` where given."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(variants))
    parser.add_argument("--max-cache-len", type=int, default=SESSION_SHAPE["max_cache_len"])
    parser.add_argument("--replays", type=int, default=SESSION_SHAPE["replays"])
    parser.add_argument("--batch", type=int, default=batch)
    args = parser.parse_args()
    SESSION_SHAPE.update(max_cache_len=args.max_cache_len, replays=args.replays)
    device = torch.device("cuda")
    model, input_ids = bench_model_and_prompts(args.batch, device)

    def run(name: str) -> dict:
        return timed_session(model, input_ids, *variants[name])

    with torch.inference_mode():
        rows = alternating_step_rounds(args.variants.split(","), args.rounds, run, reference)
    result = {"environment": environment(device), "settings": vars(args), "rows": rows}
    if report is not None:
        result["report"] = report
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def alternating_step_rounds(names: list[str], rounds: int, run: Callable[[str], dict], reference: str) -> list[dict]:
    """The session probes' rounds: ``run(name)`` gives ``{"us_per_step", "tokens"}`` for one fresh session of
    variant ``name``; the variants alternate over ``rounds`` (so that a drift of the GPU's clock reaches each alike).
    Returns one row per variant: the median µs per step, the samples, whether its tokens were the same every round,
    and the first step where they part from variant ``reference``'s (None: all equal)."""
    runs = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            runs[name].append(run(name))
            print(name, runs[name][-1]["us_per_step"], flush=True)
    reference_tokens = runs.get(reference, runs[names[0]])[0]["tokens"]
    rows = []
    for name, samples in runs.items():
        tokens = samples[0]["tokens"]
        row = {
            "variant": name,
            "us_per_step": statistics.median(sample["us_per_step"] for sample in samples),
            "samples_us": [sample["us_per_step"] for sample in samples],
            "tokens_stable_over_rounds": all(sample["tokens"] == tokens for sample in samples),
            f"first_token_differing_from_{reference}": next(
                (i for i, (a, b) in enumerate(zip(tokens, reference_tokens, strict=True)) if a != b), None
            ),
        }
        rows.append(row)
        print(row, flush=True)
    return rows


def make_timer(device: torch.device, **kwargs) -> CudaTimer | CpuTimer:
    return CudaTimer(device, **kwargs) if device.type == "cuda" else CpuTimer(device, **kwargs)


def measure_copy_tb_per_s(device: torch.device, nbytes: int = 2 * 1024**3) -> dict:
    """The memory ceiling, measured: a device-to-device copy, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)  # random data, never zeros
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return {"copy_bytes": 2 * nbytes, "copy_ms": ms, "copy_tb_per_s": 2 * nbytes / (ms * 1e-3) / 1e12}


def measure_matmul_tflops(device: torch.device, n: int = 8192) -> dict:
    """The compute ceiling, measured: a bf16 n x n x n matrix product (2 n^3 FLOPs) on random data."""
    import triton.testing

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return {"matmul_n": n, "matmul_ms": ms, "matmul_tflops": 2 * n**3 / (ms * 1e-3) / 1e12}


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (header, key, format spec); a missing or None value prints as '-'."""
    cells = [[header for header, _, _ in columns]]
    for row in rows:
        line = []
        for _, key, spec in columns:
            value = row.get(key)
            line.append("-" if value is None else format(value, spec) if spec else str(value))
        cells.append(line)
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells)
