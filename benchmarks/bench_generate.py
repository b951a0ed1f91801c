"""End to end: how fast does HF ``generate`` decode with flashcore, against HF's own eager and compiled paths?

A random-weight Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32/8 heads, head_dim 64, intermediate 8192,
vocab 128256, tied embeddings, llama3 RoPE), bf16, a prompt of 512 random token ids, 256 new tokens, greedy,
B in {1, 16}. Eleven paths, each warmed up with one full generate (compilation happens there) and then timed
(HF's two first, so that a time-budget cut never loses the reference). The three eager paths, host-bound, are timed
together: their timed generates alternate (``--no-interleave-eager`` times them one after another):

- ``stock_eager``: sdpa attention + DynamicCache, eager (HF's default);
- ``stock_static_compiled``: ``cache_implementation="static"``; transformers 5.x then compiles the decode step
  itself (a compileable cache on CUDA makes generate call ``get_compiled_call``, default
  ``CompileConfig(mode="reduce-overhead")``, i.e. inductor with CUDA graphs);
- ``flashcore_eager``: ``apply_flashcore_to_llama`` + ``FlashCoreCache``, ``generate(disable_compile=True)``;
- ``flashcore_compiled``: the same, letting generate compile the decode step (FlashCoreCache is compileable; the
  patched model's ``get_compiled_call`` gives a ``torch.compile`` of the forward replayed in flashcore's CUDA graphs,
  ``integrations/compiled_step.py``, where HF's gives inductor's CUDA-graph trees);
- ``flashcore_session``: flashcore's own loop, :class:`flashcore.integrations.decode_session.DecodeSession`,
  over the same patched model: prefill, then each token one CUDA-graph replay (greedy inside the graph); the
  tokens are read once at the end (``DecodeSession.text()``), so no step waits on the host or copies its token.
  One session per (model, batch size), reset between generates: from the row's second generate on (the first timed
  one) its prefill of the same prompt shape replays a CUDA graph too (``capture_prefill``, NOTES.md entry 87);
- ``flashcore_session_compiled``: the same loop with ``DecodeSession(compile=True)``: the captured step is a
  ``torch.compile``d forward (inductor fuses the norms, RoPE and elementwise ops between the GEMMs);
- ``flashcore_session_fused``: ``DecodeSession(compile=True, fuse_projections=True)``: also one GEMM for q/k/v
  and one for gate/up per layer, on its own copy of the model (the fusion is in place);
- ``kernels_eager``, ``kernels_compiled``, ``kernels_session``, ``kernels_session_compiled``: the first four
  flashcore paths again, on a copy of the model with ``fuse_projections=True, layer_kernels=True`` (RMSNorm, RoPE and
  SiLU-and-mul on flashcore's kernels, the same kernels on every path).

Reported per row: tok/s = B * 256 / generate time, ms per step = time / 256 (issue 5's definition, prefill
included), the decode-only ms per step (time minus a 1-token generate, the median of three, over 255), and
model-bandwidth utilisation = (weight bytes + KV bytes read per decode step) / decode step time / the device-memory
copy measured at the run's start. Inductor's "skipping cudagraphs" warnings and its cudagraph_skips counter are
recorded per path. Greedy tokens are compared with the eager path of the same model (issue 5: identical) and with
stock eager (reported). Warm-up (issue 29): the warm-up generate's total time, and the seconds from its call to each
of its first three tokens (``warmup_first_tokens_s``: the prefill's token, then the first decode step's, where HF's
compile and a compiled session's compile happen, then the second's, where a session captures its graph). Paths run
in the order above, in one process, so a later path finds the Triton kernels an earlier one compiled.

    python benchmarks/bench_generate.py --out DIR             # ~5-7 min on an H100, most of it compiling
    TRITON_INTERPRET=1 python benchmarks/bench_generate.py --dry-run --out /tmp/x   # tiny model on the CPU: tests
        # the script only (the interpreter runs the layer-kernel paths; ~6 min)
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time

import harness
import torch

# Each flashcore path: which copy of the model it runs (each is patched in place) and how it decodes.
FLASHCORE_PATHS = {
    "flashcore_eager": ("plain", "eager"),
    "flashcore_compiled": ("plain", "compiled"),
    "flashcore_session": ("plain", "session"),
    "flashcore_session_compiled": ("plain", "session_compiled"),
    "flashcore_session_fused": ("fused", "session_compiled"),
    "kernels_eager": ("kernels", "eager"),
    "kernels_compiled": ("kernels", "compiled"),
    "kernels_session": ("kernels", "session"),
    "kernels_session_compiled": ("kernels", "session_compiled"),
}
# The model each variant's tokens must equal: its own eager generate.
EAGER_PATH = {"plain": "flashcore_eager", "fused": "flashcore_eager", "kernels": "kernels_eager"}
# The reference (HF's best) runs second, so that a time-budget cut never leaves a batch size without it.
PATHS = ("stock_eager", "stock_static_compiled", *FLASHCORE_PATHS)
# Host-bound paths whose timed generates alternate (Runner.run_interleaved), so a drift of the host's speed reaches
# each alike: run one after another, flashcore's eager tok/s over stock's moved from 0.73x to 1.12x between runs on
# the H100 machine (NOTES.md, entry 40).
EAGER_PATHS = ("stock_eager", "flashcore_eager", "kernels_eager")
KV_ELEM_BYTES = 2  # bf16
WARMUP_STAMPED_TOKENS = 3  # the warm-up's first tokens whose times are recorded
PREFILL_SAMPLES = 3  # 1-token generates per row, for the prefill time that decode_ms_per_step subtracts


def build_config(is_tiny: bool):
    from transformers import LlamaConfig

    rope = {  # Llama-3.2's
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    sizes = dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
    )
    if is_tiny:  # same head layout, toy widths: for --dry-run on the CPU
        sizes.update(hidden_size=128, num_hidden_layers=2, head_dim=4, intermediate_size=256, vocab_size=1000)
    return LlamaConfig(
        **sizes,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=None,  # random weights: never stop early, always generate exactly max_new_tokens
        pad_token_id=0,
    )


def build_model(config, device: torch.device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class WarningCapture(logging.Handler):
    """Keeps the WARNING+ records of torch._inductor / torch._dynamo (recompiles, skipped cudagraphs)."""

    LOGGERS = ("torch._inductor", "torch._dynamo")

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:1500])

    def __enter__(self):
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


def enable_cudagraph_skip_logging() -> None:
    """Inductor logs a skipped CUDA graph as a perf hint, which is off by default and does not propagate:
    switch it on. (The "cudagraphs" artifact of newer torch would also log every cudagraph-tree step with a
    stack trace, ~200 MB per run; the cudagraph_skips counter is the check that counts.)"""
    try:
        torch._logging.set_logs(perf_hints=True)
    except Exception:  # noqa: BLE001  (a torch without this artifact)
        pass


def cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


class TokenStamps:
    """A logits processor (called once per token, after the forward) that stamps the first tokens' times."""

    def __init__(self, runner: Runner, stamps: list):
        self.runner, self.stamps = runner, stamps

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.runner.stamp(self.stamps, scores)


class Runner:
    """Builds the two models once, then runs any (path, batch) pair as one guarded row."""

    def __init__(self, args: argparse.Namespace, device: torch.device, copy_tb_per_s: float | None = None):
        self.args = args
        self.device = device
        self.copy_tb_per_s = copy_tb_per_s  # the bandwidth column's ceiling (see bandwidth)
        self.config = build_config(args.dry_run)
        self.stock_model = build_model(self.config, device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.stock_model.parameters())
        # Copied before anything is compiled (a compiled model holds a compiled callable that does not deep-copy).
        # Each variant gets a copy of its own: fusing the projections and the layer kernels change it in place.
        variants = {FLASHCORE_PATHS[path][0] for path in args.paths if path in FLASHCORE_PATHS}
        self.flashcore_bases = {variant: copy.deepcopy(self.stock_model) for variant in sorted(variants)}
        self.flashcore_models: dict[str, object] = {}
        self.flashcore_error: str | None = None
        generator = torch.Generator().manual_seed(1234)
        self.prompts = {
            batch: torch.randint(0, self.config.vocab_size, (batch, args.prompt_len), generator=generator)
            for batch in args.batches
        }
        self.tokens: dict[tuple[str, int], torch.Tensor] = {}
        self.caches: dict[tuple[str, int], object] = {}
        self.sessions: dict[tuple[int, int, bool], object] = {}

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def flashcore(self, variant: str):
        """The variant's copy of the stock model (same weights), patched on first use: flashcore applied
        ("plain"), its projections fused too ("fused"), and its norms, RoPE and SiLU-and-mul on flashcore's
        kernels too ("kernels")."""
        if variant not in self.flashcore_models and self.flashcore_error is None:
            try:
                from flashcore.integrations.llama import apply_flashcore_to_llama

                model = apply_flashcore_to_llama(
                    self.flashcore_bases[variant],
                    fuse_projections=variant in ("fused", "kernels"),
                    layer_kernels=variant == "kernels",
                )
                self.flashcore_models[variant] = model
            except Exception as error:  # noqa: BLE001  (recorded on every flashcore row)
                self.flashcore_error = f"{type(error).__name__}: {error}"
        if variant not in self.flashcore_models:
            raise RuntimeError(f"flashcore integration unavailable: {self.flashcore_error}")
        return self.flashcore_models[variant]

    def flashcore_cache(self, path: str, batch: int):
        """One FlashCoreCache per (path, batch), reset before each generate: a compiled step keeps its CUDA graph
        only while the cache tensors keep their addresses, as HF does with its own StaticCache."""
        key = (path, batch)
        if key in self.caches:
            try:
                self.caches[key].reset()
                return self.caches[key]
            except Exception:  # noqa: BLE001  (no usable reset: a new cache, recorded on the row)
                self.caches[key + ("reset_failed",)] = True
        from flashcore.integrations.llama import FlashCoreCache

        cache = FlashCoreCache(
            self.config,
            self.args.prompt_len + self.args.new_tokens,
            max_batch_size=batch,
            device=self.device,
            dtype=torch.bfloat16,
        )
        self.caches[key] = cache
        return cache

    def generate(self, path: str, batch: int, max_new_tokens: int, stamps: list | None = None) -> torch.Tensor:
        """The path's generate of ``max_new_tokens``; with ``stamps``, the host clock (after a sync) is appended
        there as each of the first ``WARMUP_STAMPED_TOKENS`` tokens is ready."""
        ids = self.prompts[batch].to(self.device)
        kwargs = dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
        if stamps is not None and not FLASHCORE_PATHS.get(path, ("", ""))[1].startswith("session"):
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([TokenStamps(self, stamps)])
        if path == "stock_eager":
            return self.stock_model.generate(**kwargs)
        if path == "stock_static_compiled":
            return self.stock_model.generate(**kwargs, cache_implementation="static")
        variant, mode = FLASHCORE_PATHS[path]
        model = self.flashcore(variant)
        if mode.startswith("session"):
            return self.session_generate(model, ids, max_new_tokens, compile=mode == "session_compiled", stamps=stamps)
        from flashcore.integrations.llama import CACHE_ARGUMENT_NAME

        cache = self.flashcore_cache(path, batch)
        return model.generate(**kwargs, **{CACHE_ARGUMENT_NAME: cache}, disable_compile=mode == "eager")

    def stamp(self, stamps: list, passthrough=None):
        """Appends the host clock once the device is done, for the first ``WARMUP_STAMPED_TOKENS`` tokens."""
        if len(stamps) < WARMUP_STAMPED_TOKENS:
            self.synchronize()
            stamps.append(time.perf_counter())
        return passthrough

    def session_generate(
        self, model, ids: torch.Tensor, max_new_tokens: int, *, compile: bool, stamps: list | None = None
    ) -> torch.Tensor:
        """One DecodeSession per (model, batch size, compile), reset between generates: its captured graph is
        reused."""
        from flashcore.integrations.decode_session import DecodeSession

        batch = ids.shape[0]
        key = (id(model), batch, compile)
        if key not in self.sessions:
            max_cache_len = self.args.prompt_len + self.args.new_tokens
            self.sessions[key] = DecodeSession(model, max_cache_len=max_cache_len, batch_size=batch, compile=compile)
        session = self.sessions[key]
        session.reset()
        session.prefill(ids)
        if stamps is not None:
            self.stamp(stamps)
        for _ in range(max_new_tokens - 1):
            session.decode_step()
            if stamps is not None:
                self.stamp(stamps)
        # The prompt and every token picked, read once at the end: no copy per step (4.7 µs a B=1 step on the H100,
        # NOTES.md, entry 59)
        return torch.stack(session.text())

    def timed_generate(self, path: str, batch: int, max_new_tokens: int) -> tuple[float, torch.Tensor]:
        self.synchronize()
        started = time.perf_counter()
        out = self.generate(path, batch, max_new_tokens)
        self.synchronize()
        return time.perf_counter() - started, out

    def warm_up(self, row: dict) -> None:
        """The row's first generate: its time, and the seconds from its call to each of its first tokens."""
        stamps: list[float] = []
        self.synchronize()
        started = time.perf_counter()
        self.generate(row["path"], row["B"], self.args.new_tokens, stamps=stamps)
        self.synchronize()
        row["warmup_s"] = time.perf_counter() - started
        row["warmup_first_tokens_s"] = [round(stamp - started, 4) for stamp in stamps]
        row["warmup_first_token_s"] = row["warmup_first_tokens_s"][0]

    def run(self, row: dict) -> None:
        """One row: a warm-up generate, ``n_timed`` timed ones, and a 1-token one for the prefill."""
        path, batch, args = row["path"], row["B"], self.args
        skips_before = cudagraph_skips()
        with WarningCapture() as captured:
            self.warm_up(row)  # compiles, if it compiles
            times = []
            for _ in range(args.n_timed):
                elapsed, out = self.timed_generate(path, batch, args.new_tokens)
                times.append(elapsed)
            self.time_prefill(row)
        row["cudagraph_skips"] = cudagraph_skips() - skips_before
        row["warnings"] = captured.messages[:20]
        row["skipping_cudagraphs"] = [m for m in captured.messages if "skipping cudagraphs" in m][:5]
        self.summarize(row, times, out)

    def run_interleaved(self, rows: list[dict]) -> None:
        """Rows of one batch size whose timed generates alternate: the paths' i-th timed generates run one after
        another, in alternating order, so that a drift of the host's speed (the eager paths are host-bound) reaches
        every path alike. Each row still gets its own warm-up and prefill generates."""
        args = self.args
        outs = {}
        for row in rows:
            self.warm_up(row)
            row["timing"] = "interleaved with " + ", ".join(other["path"] for other in rows if other is not row)
        times = {id(row): [] for row in rows}
        for round_index in range(args.n_timed):
            for row in rows if round_index % 2 == 0 else reversed(rows):
                elapsed, outs[id(row)] = self.timed_generate(row["path"], row["B"], args.new_tokens)
                times[id(row)].append(elapsed)
        stock = next((row for row in rows if row["path"] == "stock_eager"), None)
        for row in rows:
            self.time_prefill(row)
            row["cudagraph_skips"], row["warnings"], row["skipping_cudagraphs"] = 0, [], []
            self.summarize(row, times[id(row)], outs[id(row)])
            if stock is not None and row is not stock:
                # Paired by round: stock's i-th time over this path's i-th, which ran next to it. A drift of the
                # host's speed cancels within a pair, so their median is steadier than the ratio of the medians.
                ratios = [a / b for a, b in zip(times[id(stock)], times[id(row)], strict=True)]
                row["speedup_vs_stock_eager_by_round"] = [round(r, 4) for r in ratios]
                row["speedup_vs_stock_eager_paired_median"] = round(statistics.median(ratios), 4)
            row["status"] = "ok"

    def time_prefill(self, row: dict) -> None:
        """``prefill_s``: the median of ``PREFILL_SAMPLES`` 1-token generates. One sample can be far off: in the run
        at 1b6444e one took 91 ms where the other B=1 rows' took 15-34 ms, which took about 0.26 ms off that row's
        decode step (`probes/results/bench_generate_single_prefill_1b6444e.json`, NOTES.md entry 54)."""
        samples = [self.timed_generate(row["path"], row["B"], 1)[0] for _ in range(PREFILL_SAMPLES)]
        row["prefill_samples_s"] = [round(t, 4) for t in samples]
        row["prefill_s"] = statistics.median(samples)

    def summarize(self, row: dict, times: list[float], out: torch.Tensor) -> None:
        """The row's figures from its timed generates' seconds and the last one's output ids."""
        path, batch, args = row["path"], row["B"], self.args
        if (path, batch, "reset_failed") in self.caches:
            row["cache_reset_failed"] = True
        new = out[:, args.prompt_len :].cpu()
        row["generated_tokens"] = new.shape[1]
        if new.shape[1] != args.new_tokens:
            raise RuntimeError(f"generated {new.shape[1]} tokens, expected {args.new_tokens}")
        self.tokens[(path, batch)] = new
        row["times_s"] = [round(t, 4) for t in times]
        median_s = statistics.median(times)
        row["median_s"] = median_s
        row["tok_per_s"] = batch * args.new_tokens / median_s
        row["ms_per_step"] = 1e3 * median_s / args.new_tokens
        decode_s = median_s - row["prefill_s"]
        # A 1-token generate slower than the whole one means noise swamps the split: fall back to ms_per_step.
        row["decode_ms_per_step"] = 1e3 * decode_s / (args.new_tokens - 1) if decode_s > 0 else None
        row["bandwidth_basis"] = "decode_ms_per_step" if decode_s > 0 else "ms_per_step"
        row.update(self.bandwidth(batch, row[row["bandwidth_basis"]]))

    def bandwidth(self, batch: int, step_ms: float) -> dict:
        """Bytes one decode step must read: every weight once (the tied embedding once, as the LM head), plus
        K and V of every layer for the average context, prompt_len + new_tokens / 2. The share is of the
        device-memory copy measured at the start of the same run (``ceilings.copy_tb_per_s``); a run with no
        measured ceiling (``--dry-run``) records none."""
        config, args = self.config, self.args
        avg_context = args.prompt_len + args.new_tokens / 2
        kv_bytes = 2 * config.num_hidden_layers * batch * config.num_key_value_heads * config.head_dim
        kv_bytes = int(kv_bytes * avg_context * KV_ELEM_BYTES)
        step_bytes = self.weight_bytes + kv_bytes
        tb_per_s = step_bytes / (step_ms * 1e-3) / 1e12
        return {
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_step": kv_bytes,
            "step_tb_per_s": tb_per_s,
            "bandwidth_util_pct": 100 * tb_per_s / self.copy_tb_per_s if self.copy_tb_per_s else None,
        }


def agreement(runner: Runner) -> dict:
    """Greedy tokens: each flashcore path against the eager generate of its model (issue 5: identical), and every
    path against stock eager."""

    def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
        same = a == b
        first_diff = [int((~row).nonzero()[0]) if not bool(row.all()) else None for row in same]
        return {
            "identical": bool(same.all()),
            "rows_identical": int(sum(d is None for d in first_diff)),
            "rows": len(first_diff),
            "first_divergence_per_row": first_diff,
        }

    result = {}
    for batch in runner.args.batches:
        tokens = {path: runner.tokens.get((path, batch)) for path in PATHS}
        pairs = [(EAGER_PATH[variant], path) for path, (variant, mode) in FLASHCORE_PATHS.items() if mode != "eager"]
        pairs += [("stock_eager", p) for p in PATHS[1:]]
        for a, b in pairs:
            if tokens[a] is not None and tokens[b] is not None:
                result[f"B{batch} {a} vs {b}"] = compare(tokens[a], tokens[b])
    return result


COLUMNS = [
    ("path", "path", ""),
    ("B", "B", ""),
    ("tok/s", "tok_per_s", ".1f"),
    ("ms/step", "ms_per_step", ".2f"),
    ("decode ms/step", "decode_ms_per_step", ".2f"),
    ("% of copy", "bandwidth_util_pct", ".0f"),
    ("warmup s", "warmup_s", ".1f"),
    ("1st token s", "warmup_first_token_s", ".2f"),
    ("cg skips", "cudagraph_skips", ""),
    ("status", "status", ""),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="result folder (default: $OUT, else benchmarks/results)")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    parser.add_argument("--prompt-len", type=int, default=512, help="random prompt token ids per row")
    parser.add_argument("--new-tokens", type=int, default=256, help="greedy tokens generated per row")
    # 3: the median then ignores one slow generate. With 2 it was their mean, and at 8aaf90e one of two replayed B=1
    # session generates took 40 ms longer than the other, 0.08 ms a decode step (NOTES.md, entry 58).
    parser.add_argument("--n-timed", type=int, default=3, help="timed generates per row, after one warm-up")
    parser.add_argument("--time-budget-s", type=float, default=420.0, help="skip the remaining rows after this")
    parser.add_argument(
        "--no-interleave-eager",
        dest="interleave_eager",
        action="store_false",
        help="time the eager paths one after another instead of alternating their timed generates",
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU: checks the script only")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.paths = [p for p in args.paths.split(",") if p]
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; choose from {PATHS}")
    if args.new_tokens < 2 or args.n_timed < 1:
        parser.error("--new-tokens must be >= 2 and --n-timed >= 1")
    if args.dry_run:
        args.batches = [min(b, 2) for b in args.batches]
        args.prompt_len, args.new_tokens, args.n_timed = min(args.prompt_len, 16), min(args.new_tokens, 4), 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    formulas = {
        "tok_per_s": "B * new_tokens / median generate time (prefill included)",
        "ms_per_step": "median generate time / new_tokens",
        "decode_ms_per_step": "(median generate time - median 1-token generate time) / (new_tokens - 1)",
        "bandwidth_util_pct": Runner.bandwidth.__doc__
        + " Over decode_ms_per_step (row's bandwidth_basis says if ms_per_step was used).",
    }
    device, payload, json_path, png_path = harness.start_run("bench_generate", args, formulas=formulas)
    # The ceiling the bandwidth column counts against, measured on this GPU (an H100 and an H200 differ by ~1.4x).
    payload["ceilings"] = harness.measure_copy_tb_per_s(device) if device.type == "cuda" else {}
    enable_cudagraph_skip_logging()
    runner = Runner(args, device, payload["ceilings"].get("copy_tb_per_s"))
    payload["model"] = {
        "config": {k: v for k, v in runner.config.to_dict().items() if isinstance(v, (int, float, str, dict))},
        "weight_bytes": runner.weight_bytes,
    }
    # Batch-major, so that a time-budget cut loses the last B=16 rows rather than a whole path.
    for batch in args.batches:
        eager = [path for path in args.paths if path in EAGER_PATHS] if args.interleave_eager else []
        if len(eager) > 1:
            rows = [{"path": path, "B": batch} for path in eager]
            harness.log(f"[{', '.join(eager)} B={batch}, interleaved]  (t={time.perf_counter() - started:.0f}s)")
            group = {"path": "+".join(eager), "B": batch}
            harness.run_guarded(group, lambda _, rows=rows: runner.run_interleaved(rows))
            for row in rows:
                if group["status"] != "ok":
                    row.update(status=group["status"], error=group.get("error"), traceback=group.get("traceback"))
                else:
                    paired = row.get("speedup_vs_stock_eager_paired_median")
                    paired = f", {paired:.3f}x stock_eager (median of per-round ratios)" if paired else ""
                    speed = f"{row['tok_per_s']:.1f} tok/s, {row['ms_per_step']:.2f} ms/step"
                    harness.log(f"  {row['path']}: {speed}{paired}")
                row["wall_s"] = group["wall_s"]
                payload["rows"].append(row)
            payload["agreement"] = agreement(runner)
            harness.write_json(json_path, payload)
        for path in args.paths:
            if len(eager) > 1 and path in eager:
                continue
            row = {"path": path, "B": batch}
            harness.log(f"[{path} B={batch}]  (t={time.perf_counter() - started:.0f}s)")
            if time.perf_counter() > started + args.time_budget_s:
                row.update(status="skipped", reason=f"time budget of {args.time_budget_s:.0f}s spent")
            else:
                if "compiled" in FLASHCORE_PATHS.get(path, (None, path))[1]:
                    # Both models compile the same Module.__call__ code, so they share dynamo's cache and its
                    # recompile limit; a new batch size or model recompiles anyway. Start each compiled row empty.
                    torch._dynamo.reset()
                harness.run_guarded(row, runner.run)
                if row["status"] == "ok":
                    harness.log(f"  {row['tok_per_s']:.1f} tok/s, {row['ms_per_step']:.2f} ms/step")
            payload["rows"].append(row)
            payload["agreement"] = agreement(runner)
            harness.write_json(json_path, payload)
    harness.finish_run(payload, json_path, started)
    harness.log(f"\n== HF generate, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy ==")
    harness.log(harness.format_table(payload["rows"], COLUMNS))
    for name, result in payload["agreement"].items():
        harness.log(f"tokens {name}: {result['rows_identical']}/{result['rows']} rows identical")
    for row in payload["rows"]:
        if row.get("status") in ("error", "skipped"):
            harness.log(f"{row['status']}: {row['path']} B={row['B']}: {row.get('error') or row.get('reason')}")
        if row.get("skipping_cudagraphs"):
            harness.log(f"{row['path']} B={row['B']}: {row['skipping_cudagraphs'][0][:300]}")
    harness.draw_plot("plot_generate", payload, json_path, png_path)
    return payload


if __name__ == "__main__":
    main()
