"""Is flashcore's append-and-attend faster than torch SDPA? Decode, prefill, chunked prefill and mixed batches.

Issue 5's attention targets, measured side by side with the reference in one run (bf16, CUDA):

- decode (S_q = 1, the append included on both sides): H_q 32 / H_kv 8 / D 128, B in {1, 8, 32, 64} x
  L in {1k, 4k, 32k}, plus SmolLM2-like (9/3 heads, D 64) and MHA (32/32, D 128) points. The reference is what
  a user without flashcore writes: copy the new K/V into the cache slot L, then SDPA (``enable_gqa=True``) over
  ``K[:, :, :L + 1]``. Timed eagerly and under CUDA-graph replay, plus the host time per eager call;
- prefill: causal, B 1, 32/8 heads, D 128, S in {2k, 8k, 16k}, empty cache, against SDPA ``is_causal=True``;
- chunked prefill (512 new tokens on an 8k cache) and a mixed batch (2 rows prefilling 512 tokens next to 6
  rows decoding at L = 4k, via ``query_lens``), against SDPA run per row.

Each side appends into its own cache, both holding the same values: flashcore's from ``flashcore.allocate_kv_cache``
(each token's heads together), SDPA's a contiguous ``[B, H_kv, S_max, D]`` tensor (HF's StaticCache layout, the
one SDPA is usually given). Every row first checks flashcore's output once against SDPA's, and the append itself
(slots, ``seq_lens``, NaN-poisoned slots untouched), then times both sides (see ``harness.py`` for how, and why not
do_bench directly). Ratios are ``sdpa_us / flashcore_us``: above 1 means flashcore is faster.

    python benchmarks/bench_attention.py --out DIR            # the full run, ~3-5 min on an H100
    python benchmarks/bench_attention.py --quick --out DIR    # a subset
    python benchmarks/bench_attention.py --dry-run --out /tmp/x   # tiny shapes on the CPU: tests the script only
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import harness
import torch.nn.functional as F
from attention_calls import (
    ELEM_BYTES,
    HOST_MAX_CALLS,
    Context,
    add_rates,
    cache_bytes,
    fits,
    make_sets,
    measure,
)

GQA_DECODE = [(b, n) for b in (1, 8, 32, 64) for n in (1024, 4096, 32768)]
SMOL_DECODE = [(1, 1024), (1, 4096), (8, 4096), (64, 4096)]
MHA_DECODE = [(1, 1024), (1, 4096), (1, 32768), (8, 4096), (32, 4096)]
PREFILL_LENS = [2048, 8192, 16384]
QUICK_GQA_DECODE = [(1, 1024), (1, 4096), (1, 32768), (8, 4096), (8, 32768), (64, 1024)]
# --dry-run maps each length onto a tiny one, so the CPU walks the same rows in seconds.
DRY_RUN_LEN = {1024: 64, 4096: 128, 32768: 256, 2048: 64, 8192: 128, 16384: 192, 512: 16}


def decode_bytes(batch: int, num_q_heads: int, num_kv_heads: int, cache_len: int, head_dim: int) -> int:
    """Fewest bytes one decode call must move: read the cached K and V (2 * B * H_kv * L * D elements), read
    the new k, v and write them into the cache (2 * 2 * B * H_kv * D), read q and write out (2 * B * H_q * D)."""
    elements = 2 * batch * num_kv_heads * cache_len * head_dim
    elements += 4 * batch * num_kv_heads * head_dim + 2 * batch * num_q_heads * head_dim
    return ELEM_BYTES * elements


def attention_flops(num_q_heads: int, head_dim: int, lens_before: list[int], new_lens: list[int]) -> int:
    """4 * H_q * D FLOPs (QK^T and PV, a multiply-add each) per (query, visible key) pair, summed over rows;
    new token i of a row with L cached tokens sees L + i + 1 keys (bottom-right causal)."""
    pairs = sum(n * length + n * (n + 1) // 2 for length, n in zip(lens_before, new_lens, strict=True))
    return 4 * num_q_heads * head_dim * pairs


def prefill_flops(batch: int, num_q_heads: int, seq_len: int, head_dim: int) -> int:
    """The usual causal prefill count, 4 * B * H_q * S * S * D / 2 (the mask halves the square)."""
    return 4 * batch * num_q_heads * seq_len * seq_len * head_dim // 2


def decode_row(ctx: Context, row: dict) -> None:
    batch, num_q_heads, num_kv_heads, head_dim = row["B"], row["H_q"], row["H_kv"], row["D"]
    cache_len = row["L"]
    s_max = cache_len + ctx.args.headroom
    kv_read_bytes = 2 * batch * num_kv_heads * cache_len * head_dim * ELEM_BYTES
    n_sets = harness.rotation_sets(kv_read_bytes, ctx.args.max_rotation_sets)
    row.update(S_max=s_max, rotation_sets=n_sets, kv_read_mb=kv_read_bytes / 1e6)
    if not fits(row, ctx, cache_bytes(n_sets, batch, num_kv_heads, s_max, head_dim)):
        return
    row["fc_kv_splits"] = planned_kv_splits(ctx, num_q_heads // num_kv_heads, batch, num_kv_heads, s_max, head_dim)
    lens_before, new_lens = [cache_len] * batch, [1] * batch
    sets, reset = make_sets(
        ctx, row["name"], n_sets, (batch, num_q_heads, 1, head_dim), (batch, num_kv_heads, 1, head_dim),
        s_max, lens_before, new_lens,
    )  # fmt: skip
    measure(row, ctx, sets, reset, lens_before, new_lens, use_graph=True)
    if ctx.device.type == "cuda" and not ctx.args.no_dobench:
        # SDPA alone over the slice, timed by triton's own do_bench / do_bench_cudagraph: how issue 5's
        # baseline table was measured, and a check on harness.py's numbers for the same kernel.
        import triton.testing

        s = sets[0]
        keys, values = s.sdpa_k_cache[:, :, : cache_len + 1], s.sdpa_v_cache[:, :, : cache_len + 1]

        def sdpa_only():
            return F.scaled_dot_product_attention(s.q, keys, values, enable_gqa=True)

        row["sdpa_only_dobench_us"] = 1e3 * triton.testing.do_bench(sdpa_only, warmup=10, rep=50, return_mode="median")
        row["sdpa_only_dobench_graph_us"] = 1e3 * triton.testing.do_bench_cudagraph(
            sdpa_only, rep=20, return_mode="median"
        )
    add_rates(row, ctx, nbytes=decode_bytes(batch, num_q_heads, num_kv_heads, cache_len, head_dim))


def planned_kv_splits(ctx: Context, group: int, batch: int, num_kv_heads: int, s_max: int, head_dim: int) -> int:
    """The split count flashcore's launcher picks for a decode call (context for the table). On an sm_90 GPU the
    Gluon decode kernel takes these bf16 rows."""
    from flashcore.kernels import configs
    from flashcore.kernels.gluon_sm90 import common as gluon_common
    from flashcore.kernels.gluon_sm90 import decode as gluon_decode
    from flashcore.kernels.triton import attention as triton_attention

    if gluon_common.runs_on(ctx.device) and head_dim in configs.GLUON_DECODE.head_dims:
        return gluon_decode._launch_plan(batch * num_kv_heads, s_max, group, head_dim, ctx.device)[1]
    plan = triton_attention._launch_plan(group, head_dim, batch * num_kv_heads, s_max, ELEM_BYTES, ctx.device)
    return plan.num_splits


def prefill_row(ctx: Context, row: dict) -> None:
    batch, num_q_heads, num_kv_heads, head_dim, seq_len = row["B"], row["H_q"], row["H_kv"], row["D"], row["S_q"]
    row["S_max"] = seq_len
    if not fits(row, ctx, 4 * batch * num_q_heads * seq_len * head_dim * ELEM_BYTES):
        return
    lens_before, new_lens = [0] * batch, [seq_len] * batch
    sets, reset = make_sets(
        ctx, row["name"], 1, (batch, num_q_heads, seq_len, head_dim), (batch, num_kv_heads, seq_len, head_dim),
        seq_len, lens_before, new_lens,
    )  # fmt: skip
    measure(row, ctx, sets, reset, lens_before, new_lens, use_graph=False, use_host=False)
    add_rates(row, ctx, flops=prefill_flops(batch, num_q_heads, seq_len, head_dim))


def chunked_row(ctx: Context, row: dict) -> None:
    """One launch over rows with different (cached, new) lengths; SDPA runs row by row."""
    lens_before, new_lens = row.pop("lens_before"), row.pop("new_lens")
    batch, num_q_heads, num_kv_heads, head_dim = len(lens_before), row["H_q"], row["H_kv"], row["D"]
    num_new = max(new_lens)
    s_max = max(a + n for a, n in zip(lens_before, new_lens, strict=True))
    kv_read_bytes = 2 * num_kv_heads * head_dim * ELEM_BYTES * sum(lens_before)
    n_sets = harness.rotation_sets(kv_read_bytes + 1, ctx.args.max_rotation_sets)
    row.update(B=batch, S_q=num_new, S_max=s_max, rotation_sets=n_sets, kv_read_mb=kv_read_bytes / 1e6)
    row.update(seq_lens=_run_length(lens_before), query_lens=_run_length(new_lens))
    if not fits(row, ctx, cache_bytes(n_sets, batch, num_kv_heads, s_max, head_dim)):
        return
    sets, reset = make_sets(
        ctx, row["name"], n_sets, (batch, num_q_heads, num_new, head_dim),
        (batch, num_kv_heads, num_new, head_dim), s_max, lens_before, new_lens,
    )  # fmt: skip
    measure(row, ctx, sets, reset, lens_before, new_lens, use_graph=True)
    add_rates(row, ctx, flops=attention_flops(num_q_heads, head_dim, lens_before, new_lens))


def _run_length(values: list[int]) -> str:
    """[0, 0, 4096, 4096] -> '2x0+2x4096', to keep the table narrow."""
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][1] == value:
            runs[-1][0] += 1
        else:
            runs.append([1, value])
    return "+".join(f"{count}x{value}" for count, value in runs)


def plan_rows(ctx: Context) -> list[tuple[dict, Callable]]:
    """Every row, in priority order (a time-budget cut drops the last ones first)."""
    args = ctx.args
    rows: list[tuple[dict, Callable]] = []

    def n(length: int) -> int:
        return DRY_RUN_LEN.get(length, min(length, 64)) if args.dry_run else length

    sections = set(args.sections.split(","))

    def decode(points, label, num_q_heads, num_kv_heads, head_dim):
        for batch, cache_len in points:
            batch = min(batch, 2) if args.dry_run else batch
            name = f"decode {label} B{batch} L{n(cache_len)}"
            shape = dict(B=batch, L=n(cache_len), S_q=1, H_q=num_q_heads, H_kv=num_kv_heads, D=head_dim)
            rows.append((dict(section="decode", name=name, model=label, **shape), decode_row))

    if "decode" in sections:
        decode(QUICK_GQA_DECODE if args.quick else GQA_DECODE, "gqa32/8", 32, 8, 128)
    if "prefill" in sections:
        for seq_len in PREFILL_LENS[:2] if args.quick else PREFILL_LENS:
            name = f"prefill S{n(seq_len)}"
            row = dict(section="prefill", name=name, model="gqa32/8", B=1, S_q=n(seq_len), H_q=32, H_kv=8, D=128)
            rows.append((row, prefill_row))
    if "chunked" in sections:
        chunk = dict(section="chunked", name=f"chunk {n(512)} on L{n(8192)}", model="gqa32/8", H_q=32, H_kv=8, D=128)
        rows.append(({**chunk, "lens_before": [n(8192)], "new_lens": [n(512)]}, chunked_row))
    if "mixed" in sections:
        mixed = dict(section="mixed", name=f"mixed 2x{n(512)} prefill + 6 decode L{n(4096)}", model="gqa32/8")
        mixed.update(H_q=32, H_kv=8, D=128, lens_before=[0] * 2 + [n(4096)] * 6, new_lens=[n(512)] * 2 + [1] * 6)
        rows.append((mixed, chunked_row))
    if "decode" in sections:
        decode(SMOL_DECODE[1:2] if args.quick else SMOL_DECODE, "smol9/3", 9, 3, 64)
        decode(MHA_DECODE[1:2] if args.quick else MHA_DECODE, "mha32/32", 32, 32, 128)
    return rows


# Every column of the two tables, in print order, and the table that shows it: "decode", "flop", or "both".
TABLE_COLUMNS = [
    ("row", "name", "", "both"),
    ("ok", "check_passed", "", "both"),
    ("fc eager us", "fc_eager_us", ".1f", "both"),
    ("sdpa eager us", "sdpa_eager_us", ".1f", "both"),
    ("x eager", "ratio_eager", ".2f", "both"),
    ("fc graph us", "fc_graph_us", ".1f", "both"),
    ("sdpa graph us", "sdpa_graph_us", ".1f", "decode"),
    ("x graph", "ratio_graph", ".2f", "both"),
    ("splits", "fc_kv_splits", "", "decode"),
    ("fc TB/s", "fc_tb_per_s", ".2f", "decode"),
    ("% copy", "fc_pct_of_copy", ".0f", "decode"),
    ("fc TFLOP/s", "fc_eager_tflops", ".0f", "flop"),
    ("sdpa TFLOP/s", "sdpa_eager_tflops", ".0f", "flop"),
    ("% 790", "fc_pct_of_790", ".0f", "flop"),
    ("fc host us", "fc_host_us", ".1f", "both"),
    ("sdpa host us", "sdpa_host_us", ".1f", "both"),
    ("sdpa do_bench us", "sdpa_only_dobench_us", ".1f", "decode"),
    ("sdpa do_bench graph us", "sdpa_only_dobench_graph_us", ".1f", "decode"),
    ("status", "status", "", "both"),
]
DECODE_COLUMNS = [(header, key, spec) for header, key, spec, table in TABLE_COLUMNS if table in ("decode", "both")]
FLOP_COLUMNS = [(header, key, spec) for header, key, spec, table in TABLE_COLUMNS if table in ("flop", "both")]


def print_tables(payload: dict) -> None:
    rows = payload["rows"]
    ceilings = payload["ceilings"]
    harness.log("\n== ceilings (measured in this run) ==")
    harness.log(", ".join(f"{k} {v:.3g}" for k, v in ceilings.items() if isinstance(v, float)))
    harness.log("== decode (S_q=1; ratio = sdpa_us / fc_us, > 1: flashcore faster; TB/s from decode_bytes) ==")
    harness.log(harness.format_table([r for r in rows if r["section"] == "decode"], DECODE_COLUMNS))
    harness.log("== prefill / chunked / mixed (TFLOP/s from the causal FLOP count) ==")
    harness.log(harness.format_table([r for r in rows if r["section"] != "decode"], FLOP_COLUMNS))
    for row in rows:
        if row.get("status") in ("error", "skipped"):
            harness.log(f"{row['status']}: {row['name']}: {row.get('error') or row.get('reason')}")
        elif row.get("check_passed") is False or row.get("graph_check_passed") is False:
            harness.log(
                f"CHECK FAILED: {row['name']}: append_ok {row.get('append_ok')}, max_abs_err "
                f"{row.get('max_abs_err')}, graph replay check {row.get('graph_check_passed')}"
            )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="result folder (default: $OUT, else benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="a subset of the rows, for a fast look")
    parser.add_argument("--sections", default="decode,prefill,chunked,mixed", help="comma-separated subset")
    parser.add_argument("--backend", default="triton", help="flashcore backend to time (default: triton)")
    parser.add_argument("--headroom", type=int, default=256, help="cache slots past L (S_max = L + headroom)")
    parser.add_argument("--eager-iters", type=int, default=50, help="timed eager calls per side per row")
    parser.add_argument("--graph-replays", type=int, default=20, help="timed graph replays per side per row")
    # 9 samples let one burst of load on the GPU host's shared CPUs move a row's median by 12-20 us (two
    # runs of NOTES.md entry 34, each on a different row); 21 cost ~0.5 s more per row.
    parser.add_argument("--host-samples", type=int, default=21, help="host-time samples per side per row")
    parser.add_argument(
        "--host-calls-per-set", type=int, default=HOST_MAX_CALLS, help="back-to-back calls per set per sample"
    )
    parser.add_argument(
        "--max-rotation-sets", type=int, default=harness.MAX_ROTATION_SETS, help="input sets a graph cycles through"
    )
    parser.add_argument("--mem-limit-gb", type=float, default=60.0, help="skip rows whose caches need more")
    parser.add_argument("--time-budget-s", type=float, default=330.0, help="skip the remaining rows after this")
    parser.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph timing")
    parser.add_argument(
        "--l2-flush", choices=("read", "write"), default="read", help="flush L2 by reading (default) or zeroing"
    )
    parser.add_argument("--no-host-timing", action="store_true", help="skip the host-time measurement")
    parser.add_argument("--no-dobench", action="store_true", help="skip the triton do_bench SDPA cross-check")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script only")
    args = parser.parse_args(argv)
    if args.headroom < 1:
        parser.error("--headroom must be >= 1: the decode call appends one token at L")
    if args.dry_run:
        args.backend = "torch" if args.backend == "triton" else args.backend
        args.eager_iters, args.host_samples = min(args.eager_iters, 3), min(args.host_samples, 2)
        args.host_calls_per_set, args.max_rotation_sets = min(args.host_calls_per_set, 2), 2
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    formulas = {
        "decode_bytes": decode_bytes.__doc__,
        "prefill_flops": prefill_flops.__doc__,
        "chunked_flops": attention_flops.__doc__,
        "ratio": "sdpa_us / fc_us (> 1: flashcore faster)",
        "timing": harness.__doc__,
    }
    ceilings = {"nominal_tb_per_s": harness.NOMINAL_TB_PER_S, "nominal_tflops": harness.NOMINAL_TFLOPS}
    device, payload, json_path, png_path = harness.start_run(
        "bench_attention", args, ceilings=ceilings, formulas=formulas
    )
    if device.type == "cuda":
        for measure_ceiling in (harness.measure_copy_tb_per_s, harness.measure_matmul_tflops):
            try:
                payload["ceilings"].update(measure_ceiling(device))
            except Exception as error:  # noqa: BLE001  (a ceiling is context, not a reason to stop)
                payload["ceilings"][measure_ceiling.__name__ + "_error"] = repr(error)
        harness.log(f"ceilings: {payload['ceilings']}")
    timer = harness.make_timer(
        device,
        eager_iters=args.eager_iters,
        graph_replays=args.graph_replays,
        host_samples=args.host_samples,
        l2_flush=args.l2_flush,
    )
    ctx = Context(args, device, timer, payload["ceilings"], started + args.time_budget_s)
    planned = plan_rows(ctx)
    for index, (row, body) in enumerate(planned):
        harness.log(f"[{index + 1}/{len(planned)}] {row['name']}  (t={time.perf_counter() - started:.0f}s)")
        if time.perf_counter() > ctx.deadline:
            row.update(status="skipped", reason=f"time budget of {args.time_budget_s:.0f}s spent")
        else:
            harness.run_guarded(row, lambda r, body=body: body(ctx, r))
        payload["rows"].append(row)
        harness.write_json(json_path, payload)
    harness.finish_run(payload, json_path, started)
    print_tables(payload)
    harness.draw_plot("plot_attention", payload, json_path, png_path)
    return payload


if __name__ == "__main__":
    main()
