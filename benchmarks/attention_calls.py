"""One row's calls in bench_attention.py: the inputs and caches, the two sides, their check, their timing.

A row's call sets (:class:`CallSet`) hold the new tokens and two caches with the same values, flashcore's and the
contiguous one SDPA is given; :func:`measure` checks flashcore's output and append against the SDPA reference once,
then times both sides with ``harness.py``'s timers, and :func:`add_rates` turns the times into TB/s or TFLOP/s.
"""

from __future__ import annotations

import argparse
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import harness
import torch
import torch.nn.functional as F

import flashcore

ELEM_BYTES = 2  # bf16
# Output check against SDPA (both bf16): the brief's 2e-2 absolute bound, plus 1e-2 relative so that a one-ulp
# rounding difference on an output of magnitude > 2 (bf16 ulp there is 2^-6 = 0.016) cannot fail a correct row.
CHECK_ATOL, CHECK_RTOL = 2e-2, 1e-2
HOST_MAX_CALLS = 128  # calls per host-time sample (x <= 4 launches each for SDPA's side)


@dataclass
class CallSet:
    """One call's inputs: new tokens, the caches they append to (flashcore's and SDPA's), and per-row lengths."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor  # flashcore's, from flashcore.allocate_kv_cache
    v_cache: torch.Tensor
    sdpa_k_cache: torch.Tensor  # the same values, contiguous [B, H_kv, S_max, D]
    sdpa_v_cache: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor | None = None


@dataclass
class Context:
    """What every row's body reads: the parsed arguments, the device, its timer and ceilings, and when to stop."""

    args: argparse.Namespace
    device: torch.device
    timer: harness.CudaTimer | harness.CpuTimer
    ceilings: dict
    deadline: float


def new_generator(ctx: Context, label: str) -> torch.Generator:
    return torch.Generator(device=ctx.device).manual_seed(zlib.crc32(label.encode()))


def randn(ctx: Context, shape: tuple, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.bfloat16, device=ctx.device)


def cache_bytes(n_sets: int, batch: int, num_kv_heads: int, s_max: int, head_dim: int) -> int:
    """What a row's caches take: K and V, flashcore's and SDPA's, for each input set."""
    return n_sets * 2 * 2 * batch * num_kv_heads * s_max * head_dim * ELEM_BYTES


def flashcore_cache(sdpa_cache: torch.Tensor) -> torch.Tensor:
    """A copy of SDPA's cache in the layout ``flashcore.allocate_kv_cache`` gives."""
    batch, num_kv_heads, s_max, head_dim = sdpa_cache.shape
    cache = flashcore.allocate_kv_cache(
        batch, num_kv_heads, s_max, head_dim, dtype=sdpa_cache.dtype, device=sdpa_cache.device
    )[0]
    return cache.copy_(sdpa_cache)


def new_cache(ctx: Context, shape: tuple, lens_before: list[int], generator: torch.Generator) -> torch.Tensor:
    """N(0, 1) in each row's first ``lens_before[b]`` slots, NaN past them: garbage must never reach an output."""
    cache = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=ctx.device)
    for b, length in enumerate(lens_before):
        cache[b, :, :length].normal_(generator=generator)
    return cache


def make_sets(ctx, label, n_sets, shape_q, shape_kv, s_max, lens_before, new_lens) -> tuple[list, Callable]:
    """``n_sets`` independent call sets whose ``seq_lens`` are rows of one tensor, so one copy resets them all."""
    generator = new_generator(ctx, label)
    batch, num_kv_heads, _, head_dim = shape_kv
    seq_lens_all = torch.tensor([lens_before] * n_sets, dtype=torch.int32, device=ctx.device)
    initial = seq_lens_all.clone()
    is_padded = any(n != shape_q[2] for n in new_lens)
    query_lens = torch.tensor(new_lens, dtype=torch.int32, device=ctx.device) if is_padded else None
    sets = []
    for i in range(n_sets):
        cache_shape = (batch, num_kv_heads, s_max, head_dim)
        sdpa_k_cache = new_cache(ctx, cache_shape, lens_before, generator)
        sdpa_v_cache = new_cache(ctx, cache_shape, lens_before, generator)
        sets.append(
            CallSet(
                q=randn(ctx, shape_q, generator),
                k=randn(ctx, shape_kv, generator),
                v=randn(ctx, shape_kv, generator),
                k_cache=flashcore_cache(sdpa_k_cache),
                v_cache=flashcore_cache(sdpa_v_cache),
                sdpa_k_cache=sdpa_k_cache,
                sdpa_v_cache=sdpa_v_cache,
                seq_lens=seq_lens_all[i],
                query_lens=query_lens,
            )
        )
    return sets, lambda: seq_lens_all.copy_(initial)


def flashcore_call(ctx: Context, s: CallSet) -> torch.Tensor:
    out, _ = flashcore.attention_with_kv_cache(
        s.q, s.k, s.v, (s.k_cache, s.v_cache, s.seq_lens),
        is_causal=True, query_lens=s.query_lens, backend=ctx.args.backend, check=False,
    )  # fmt: skip
    return out


def sdpa_per_row(s: CallSet, lens_before: list[int], new_lens: list[int], masks: dict) -> torch.Tensor:
    """The reference a user writes without flashcore: per row, copy the new K/V into the cache, then SDPA.

    A decode row (one new token) needs no mask; a row with an empty cache is plain causal; a chunk on top of a
    cache needs the bottom-right mask (SDPA's is_causal is top-left aligned), built once, outside the timing.
    """
    if len(set(lens_before)) == 1 and len(set(new_lens)) == 1 and s.query_lens is None:
        return _sdpa_rows(s, slice(None), lens_before[0], new_lens[0], masks)  # one batched call
    out = torch.zeros_like(s.q)
    for b, (length, n) in enumerate(zip(lens_before, new_lens, strict=True)):
        if n:
            out[b : b + 1, :, :n] = _sdpa_rows(s, slice(b, b + 1), length, n, masks)
    return out


def _sdpa_rows(s: CallSet, rows: slice, length: int, n: int, masks: dict) -> torch.Tensor:
    s.sdpa_k_cache[rows, :, length : length + n].copy_(s.k[rows, :, :n])
    s.sdpa_v_cache[rows, :, length : length + n].copy_(s.v[rows, :, :n])
    keys, values = s.sdpa_k_cache[rows, :, : length + n], s.sdpa_v_cache[rows, :, : length + n]
    q = s.q[rows, :, :n]
    if n == 1:
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    if length == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[(length, n)], enable_gqa=True)


def bottom_right_masks(device, lens_before: list[int], new_lens: list[int]) -> dict:
    """(L, n) -> bool [n, L + n]: new token i sees positions <= L + i."""
    return {
        (length, n): torch.ones(n, length + n, dtype=torch.bool, device=device).tril(diagonal=length)
        for length, n in zip(lens_before, new_lens, strict=True)
        if length > 0 and n > 1
    }


def append_is_correct(s: CallSet, lens_before: list[int], new_lens: list[int]) -> bool:
    """After one flashcore call: new K/V bitwise in [L, L + n), the next slot still NaN, seq_lens += n."""
    expected = torch.tensor([a + n for a, n in zip(lens_before, new_lens, strict=True)], dtype=torch.int32)
    is_ok = torch.equal(s.seq_lens.cpu(), expected)
    s_max = s.k_cache.shape[2]
    for b, (length, n) in enumerate(zip(lens_before, new_lens, strict=True)):
        for cache, new in ((s.k_cache, s.k), (s.v_cache, s.v)):
            is_ok &= torch.equal(cache[b, :, length : length + n], new[b, :, :n])
            if length + n < s_max:
                is_ok &= bool(torch.isnan(cache[b, :, length + n]).all())
    return bool(is_ok)


def measure(
    row: dict, ctx: Context, sets: list, reset, lens_before, new_lens, *, use_graph: bool, use_host: bool = True
) -> None:
    """Check once, then time flashcore and the SDPA reference: eager, graph replay, host time per call."""
    masks = bottom_right_masks(ctx.device, lens_before, new_lens)

    def run_flashcore(s):
        return flashcore_call(ctx, s)

    def run_sdpa(s):
        return sdpa_per_row(s, lens_before, new_lens, masks)

    reset()
    out = run_flashcore(sets[0]).clone()  # also the first call: Triton compiles here, not in the timing
    row["append_ok"] = append_is_correct(sets[0], lens_before, new_lens)
    ref = run_sdpa(sets[0])
    check = harness.compare(out, ref, atol=CHECK_ATOL, rtol=CHECK_RTOL)
    row["check_passed"] = check.pop("passed") and row["append_ok"]
    row.update(check)
    harness.log(f"  check {'PASS' if row['check_passed'] else 'FAIL'}: max_abs_err {check['max_abs_err']:.2e}")

    row["fc_eager_us"] = ctx.timer.eager_us(lambda: run_flashcore(sets[0]), reset)
    row["sdpa_eager_us"] = ctx.timer.eager_us(lambda: run_sdpa(sets[0]), reset)
    if use_graph and not ctx.args.no_graphs:
        row["fc_graph_us"], outputs, graph = ctx.timer.graph_us([lambda s=s: run_flashcore(s) for s in sets], reset)
        if outputs is not None:
            replay_check = harness.compare(outputs[0], ref, atol=CHECK_ATOL, rtol=CHECK_RTOL)
            row["graph_check_passed"] = replay_check["passed"]
        del outputs, graph
        row["sdpa_graph_us"], _, _ = ctx.timer.graph_us([lambda s=s: run_sdpa(s) for s in sets], reset)
    if use_host and not ctx.args.no_host_timing:
        # Calls go round-robin over the sets; each set takes at most as many appends as its free slots allow
        # (never past capacity), and HOST_MAX_CALLS keeps the launches queued behind the sleep kernel well
        # under the GPU's launch queue depth (~1k), so the host never blocks on a full queue. Every decode row
        # gets HOST_MAX_CALLS calls per sample: at 16 (the rows with one input set, before) a per-sample
        # fixed cost added 4-16 us per call to flashcore's side and 4-12 to SDPA's (NOTES.md, entry 22).
        room = sets[0].k_cache.shape[2] - max(a + n for a, n in zip(lens_before, new_lens, strict=True))
        per_set = min(ctx.args.host_calls_per_set, 1 + room // max(new_lens))
        n_calls = min(HOST_MAX_CALLS, per_set * len(sets))
        row["host_calls_per_sample"] = n_calls
        host_us = ctx.timer.host_us(
            {
                "fc": [lambda s=s: run_flashcore(s) for s in sets],
                "sdpa": [lambda s=s: run_sdpa(s) for s in sets],
            },
            reset,
            n_calls,
        )
        row["fc_host_us"], row["sdpa_host_us"] = host_us["fc"], host_us["sdpa"]
    for mode in ("eager", "graph"):
        fc_us, sdpa_us = row.get(f"fc_{mode}_us"), row.get(f"sdpa_{mode}_us")
        if fc_us and sdpa_us:
            row[f"ratio_{mode}"] = sdpa_us / fc_us


def add_rates(row: dict, ctx: Context, *, nbytes: int | None = None, flops: int | None = None) -> None:
    """Achieved TB/s (nbytes over time) or TFLOP/s (flops over time) for every timing present on the row."""
    for side in ("fc", "sdpa"):
        for mode in ("eager", "graph"):
            us = row.get(f"{side}_{mode}_us")
            if not us:
                continue
            if nbytes is not None:
                row[f"{side}_{mode}_tb_per_s"] = nbytes / (us * 1e-6) / 1e12
            if flops is not None:
                row[f"{side}_{mode}_tflops"] = flops / (us * 1e-6) / 1e12
    best = "graph" if row.get("fc_graph_us") else "eager"
    copy_tb_per_s = ctx.ceilings.get("copy_tb_per_s")
    row["best_mode"] = best
    if nbytes is not None and row.get(f"fc_{best}_tb_per_s"):
        row["fc_tb_per_s"] = row[f"fc_{best}_tb_per_s"]
        row["fc_pct_of_3tb"] = 100 * row[f"fc_{best}_tb_per_s"] / harness.NOMINAL_TB_PER_S
        if copy_tb_per_s:
            row["fc_pct_of_copy"] = 100 * row[f"fc_{best}_tb_per_s"] / copy_tb_per_s
    if flops is not None and row.get(f"fc_{best}_tflops"):
        row["fc_tflops"] = row[f"fc_{best}_tflops"]
        row["fc_pct_of_790"] = 100 * row[f"fc_{best}_tflops"] / harness.NOMINAL_TFLOPS


def fits(row: dict, ctx: Context, alloc_bytes: int) -> bool:
    row["alloc_gb"] = round(alloc_bytes / 1e9, 3)
    limit = ctx.args.mem_limit_gb * 1e9
    if ctx.device.type == "cuda":
        limit = min(limit, 0.9 * torch.cuda.mem_get_info(ctx.device)[0])
    if alloc_bytes > limit:
        row.update(status="skipped", reason=f"needs {alloc_bytes / 1e9:.1f} GB > {limit / 1e9:.1f} GB allowed")
        return False
    return True
