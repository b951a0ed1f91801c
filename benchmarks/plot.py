"""Draws the benchmark figures, and writes the README's tables, from result JSON files alone: no GPU, no
re-measuring.

The README's PNGs and tables come from the committed files in ``benchmarks/results/``: with no file arguments,
this script redraws every ``bench_*.json`` there and rewrites README.md's generated tables
(:mod:`readme_tables`). The benchmark scripts call the plotting functions right after a run.

    python benchmarks/plot.py                                   # every benchmarks/results/bench_*.json + README
    python benchmarks/plot.py RUN/bench_attention.json --out-dir DIR   # figures only
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import readme_tables

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(payload: dict) -> str:
    env = payload.get("environment", {})
    commit = str(env.get("git_commit", "unknown"))[:12]
    note = "  DRY RUN (CPU, not a measurement)" if payload.get("dry_run") else ""
    return f"{env.get('gpu') or env.get('device')}, {str(env.get('date', ''))[:10]}, commit {commit}{note}"


def _bars(ax, labels: list[str], series: dict[str, list], ylabel: str, hatched: dict[str, list] | None = None) -> None:
    """One group of bars per label; ``hatched[name][i]`` hatches a bar (a value from a second run)."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=name)
        for bar, is_hatched in zip(bars, (hatched or {}).get(name, []), strict=False):
            if is_hatched:
                bar.set_hatch("//")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def plot_attention(payload: dict, path: Path) -> None:
    """Decode: ratio against SDPA and TB/s against the copy ceiling; prefill-like rows: TFLOP/s against 790."""
    plt = _pyplot()
    rows = [r for r in payload["rows"] if r.get("status") == "ok"]
    decode = [r for r in rows if r["section"] == "decode"]
    compute = [r for r in rows if r["section"] != "decode"]
    ceilings = payload.get("ceilings", {})
    fig, axes = plt.subplots(3, 1, figsize=(12, 13))

    labels = [r["name"].removeprefix("decode ") for r in decode]
    ratio_series = {"graph replay": [r.get("ratio_graph") for r in decode]}
    ratio_series["eager"] = [r.get("ratio_eager") for r in decode]
    _bars(axes[0], labels, ratio_series, "SDPA time / flashcore time")
    axes[0].axhline(1.0, color="black", lw=1)
    axes[0].axhline(1.3, color="gray", lw=1, ls="--", label="1.3x (B=1, L<=4k target)")
    axes[0].set_title("Decode: speed-up over torch SDPA (> 1: flashcore faster)")
    axes[0].legend(fontsize=8)

    tb_series = {
        "flashcore (graph)": [r.get("fc_graph_tb_per_s") or r.get("fc_eager_tb_per_s") for r in decode],
        "SDPA (graph)": [r.get("sdpa_graph_tb_per_s") or r.get("sdpa_eager_tb_per_s") for r in decode],
    }
    _bars(axes[1], labels, tb_series, "TB/s")
    if ceilings.get("copy_tb_per_s"):
        copy_tb = ceilings["copy_tb_per_s"]
        axes[1].axhline(copy_tb, color="red", lw=1, label=f"measured copy {copy_tb:.2f} TB/s")
        axes[1].axhline(0.85 * copy_tb, color="red", lw=1, ls=":", label="85% of copy")
    axes[1].axhline(ceilings.get("nominal_tb_per_s", 3.0), color="black", lw=1, ls="--", label="3.0 TB/s")
    axes[1].set_title("Decode: achieved bandwidth (minimum bytes / time)", pad=22)
    # Above the bars (the B1 rows are short, but not short enough for a legend over them).
    axes[1].legend(fontsize=8, ncols=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)

    flop_series = {
        "flashcore (eager)": [r.get("fc_eager_tflops") for r in compute],
        "SDPA (eager)": [r.get("sdpa_eager_tflops") for r in compute],
    }
    _bars(axes[2], [r["name"] for r in compute], flop_series, "TFLOP/s")
    axes[2].axhline(ceilings.get("nominal_tflops", 790.0), color="black", lw=1, ls="--", label="790 TFLOP/s")
    if ceilings.get("matmul_tflops"):
        axes[2].axhline(ceilings["matmul_tflops"], color="red", lw=1, label="measured bf16 matmul")
    axes[2].set_title("Prefill, chunked prefill, mixed batch: achieved TFLOP/s")
    axes[2].legend(fontsize=8)

    fig.suptitle(f"flashcore vs torch SDPA, bf16 - {_subtitle(payload)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_generate(payload: dict, path: Path, second_run: dict | None = None) -> None:
    """End to end: tok/s per path and batch size, and model-bandwidth utilisation.

    Cells the run skipped (its time budget ran out) are taken from ``second_run`` where it has them, hatched.
    """
    plt = _pyplot()
    paths = list(dict.fromkeys(r["path"] for r in payload["rows"]))
    batches = sorted({r["B"] for r in payload["rows"]})
    by_key = {(r["path"], r["B"]): r for r in payload["rows"] if r.get("status") == "ok"}
    extra = {(r["path"], r["B"]): r for r in (second_run or {}).get("rows", []) if r.get("status") == "ok"}
    from_extra = {key: row for key, row in extra.items() if key not in by_key}
    copy_tb = payload.get("ceilings", {}).get("copy_tb_per_s")
    bandwidth_ceiling = f"measured copy, {copy_tb:.2f} TB/s" if copy_tb else "3.0 TB/s"
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, ylabel, title in (
        (axes[0], "tok_per_s", "tokens / s", "HF generate throughput (prompt + decode)"),
        (axes[1], "bandwidth_util_pct", f"% of {bandwidth_ceiling}", "Model-bandwidth utilisation, decode steps"),
    ):
        series = {f"B={b}": [{**from_extra, **by_key}.get((p, b), {}).get(key) for p in paths] for b in batches}
        hatched = {f"B={b}": [(p, b) in from_extra for p in paths] for b in batches}
        _bars(ax, paths, series, ylabel, hatched)
        ax.set_title(title)
        ax.legend(fontsize=8)
        if key == "tok_per_s":
            ax.set_yscale("log")
    title = f"Llama-3.2-1B-shaped random model, bf16 - {_subtitle(payload)}"
    if from_extra:
        title += f"\nhatched: skipped in that run, from a second run ({_subtitle(second_run)})"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_serve(payload: dict, path: Path) -> None:
    """Serving: output tok/s per workload and system, and inter-token latency p50/p99 where it was streamed."""
    plt = _pyplot()
    rows = [r for r in payload["rows"] if r.get("status") == "ok" and "output_tok_per_s" in r]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    by_key = {(r["workload"], r["system"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    series = {s: [by_key.get((w, s), {}).get("output_tok_per_s") for w in workloads] for s in systems}
    _bars(axes[0], workloads, series, "output tokens / s")
    axes[0].set_yscale("log")
    axes[0].set_title("Throughput")
    axes[0].legend(fontsize=8)
    itl = {
        f"{s} {q}": [by_key.get((w, s), {}).get("itl", {}).get(f"{q}_ms") for w in workloads]
        for s in systems
        for q in ("p50", "p99")
    }
    _bars(axes[1], workloads, {k: v for k, v in itl.items() if any(x is not None for x in v)}, "ms")
    axes[1].set_yscale("log")
    axes[1].set_title("Inter-token latency (streamed systems)")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Serving, Llama-3.2-1B-shaped random model, bf16 - {_subtitle(payload)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cpu(payload: dict, path: Path) -> None:
    """CPU: flashcore's speed over stock transformers' per row (1.0 = as fast)."""
    plt = _pyplot()
    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    _bars(ax, [r["row"] for r in rows], {"stock time / flashcore time": [r["ratio"] for r in rows]}, "ratio")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_title(f"SmolLM2-135M on the CPU - {_subtitle(payload)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_multi_gpu(payload: dict, path: Path) -> None:
    """Two GPUs: a session's decode step per way of loading the model, B=1 and B=16 (lower is faster)."""
    plt = _pyplot()
    rows = readme_tables.multi_gpu_rows(payload)
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [label.replace("`", "") for label, _ in rows]
    _bars(ax, labels, {f"B={b}": [steps.get(b, {}).get("ms_per_step") for _, steps in rows] for b in (1, 16)}, "ms")
    ax.legend(fontsize=8)
    ax.set_title(f"Decode step, 1B shape, bf16 - {_subtitle(payload)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTTERS = {
    "bench_attention": plot_attention,
    "bench_generate": plot_generate,
    "bench_serve": plot_serve,
    "bench_cpu": plot_cpu,
    "bench_multi_gpu": plot_multi_gpu,
}


def plot_file(json_path: Path, out_dir: Path | None = None) -> Path:
    payload = json.loads(json_path.read_text())
    plotter = PLOTTERS.get(payload.get("benchmark", json_path.stem))
    if plotter is None:
        raise ValueError(f"{json_path}: unknown benchmark {payload.get('benchmark')!r}; known: {sorted(PLOTTERS)}")
    png_path = (out_dir or json_path.parent) / (json_path.stem + ".png")
    second_run = json_path.parent / readme_tables.GENERATE_SECOND_RUN
    if json_path.name == "bench_generate.json" and second_run.exists():
        plotter(payload, png_path, json.loads(second_run.read_text()))
    else:
        plotter(payload, png_path)
    return png_path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="result JSON files (default: benchmarks/results/)")
    parser.add_argument("--out-dir", type=Path, help="where to write the PNGs (default: beside each JSON)")
    parser.add_argument(
        "--no-readme",
        action="store_true",
        help="do not rewrite README.md's generated tables (they are rewritten only when no files are given)",
    )
    args = parser.parse_args(argv)
    files = args.files or sorted(RESULTS_DIR.glob("bench_*.json"))
    if not files:
        raise SystemExit(f"no result files given and none in {RESULTS_DIR}")
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    for json_path in files:
        print(f"{json_path} -> {plot_file(json_path, args.out_dir)}")
    if not args.files and not args.no_readme:
        names = readme_tables.update_readme()
        print(f"{readme_tables.README_PATH}: rewrote the {', '.join(names)} tables")


if __name__ == "__main__":
    main()
