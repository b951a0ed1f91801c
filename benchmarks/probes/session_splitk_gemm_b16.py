"""Issue 29: a split-K few-row GEMM with the weight as the MMA's wide side, against cuBLAS, in a B=16 replayed step.

Entry 57's few-row GEMM (``session_rows_gemm_b16.py``) put the 16 rows on the MMA's M side and gave each program a
few outputs and the whole of K: 8-32 K steps a program, one program walking its weight alone, slower than cuBLAS.
This kernel (``_splitk_gemm_kernel``) swaps the operands, as cuBLAS's small-batch kernels do: each program computes
``out.T`` for ``block_n`` weight rows (the MMA's M side, 64 or 128) and the 16 rows (its N side), over one slice of K.
Split-K gives every projection enough programs of one to four K steps each (the GEMV's shape: many short programs,
each with its weight in flight at once): a projection is cut into as many K slices as it takes to reach
``min_programs`` programs. The launch is the GEMV's (``flashcore/kernels/triton/gemv.py``): programmatic dependent
launch, each program's first weight tile loaded before ``gdc_wait``, the dependents released right after it. Each
program stores its fp32 partial; the last of a row block's programs to take the block's ticket (as the ``seq_lens``
ticket of ``split_merge.py``) adds the partials in K order, rounds once and stores the output, so the sum does not
depend on which program finishes last.

Two measurements, on ``bench_generate``'s model (bf16, the Llama-3.2-1B shape):

- ``report.shapes``: each distinct weight shape (the fused q/k/v and gate/up, o, down, the LM head) alone, 16 rows,
  cuBLAS and each tile variant: µs a call by ``triton.testing.do_bench_cudagraph`` over enough copies of the weight to
  exceed the L2 (called in turn, so each call streams its weight from HBM and the kernels chain under PDL as in a
  step), and TB/s of weight read;
- the step: a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile), 16 random
  512-token prompts, each variant's GEMM under every projection and the LM head for 2-16 rows
  (``session_rows_gemm_b16.install``), the variants alternating over ``--rounds`` rounds.

Before the first variant that runs the kernel, the probe checks it in bf16 on the model's weight shapes against fp64,
beside cuBLAS's error (``report.bf16_check``, ``session_rows_gemm_b16.check_bf16``).

    python benchmarks/probes/session_splitk_gemm_b16.py --out session_splitk_gemm_b16.json --max-cache-len 768

Since d7f1654 the library runs this kernel, with the SiLU-and-mul and the residual add folded in, as
``flashcore/kernels/triton/rows_gemm.py`` (entry 65). The probe keeps its own copy, which takes the tile variants
above (stages, programs, shapes left on cuBLAS) that the library's fixes, so that it still measures what entry 61
describes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import session_rows_gemm_b16 as rows_probe  # noqa: E402

from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch  # noqa: E402

BLOCK_M = 16  # the rows, padded: the MMA's N side


@triton.jit
def _splitk_gemm_kernel(
    x_ptr,  # [M, K], unit stride along K
    weight_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N]; read only when HAS_BIAS
    partial_ptr,  # [SPLIT_K, BLOCK_M, N] fp32 scratch; used only when SPLIT_K > 1
    tickets_ptr,  # [cdiv(N, BLOCK_N)] int32, zero between launches; used only when SPLIT_K > 1
    out_ptr,  # [M, N], contiguous
    m,
    n,
    k,
    stride_x_m,
    stride_weight_n,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs; None: tl.dot's default (fp16/bf16)
    USE_PDL: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < n, offs_m < m
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    weight_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_weight_n
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x_m

    # stage 1: the first weight tile, loaded while the kernel before may still run
    cols = k_start + tl.arange(0, BLOCK_K)
    mask_k = cols < k_end
    w = tl.load(weight_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    if USE_PDL:
        gdc_wait()  # x comes from the kernel before
        gdc_launch_dependents()
    x = tl.load(x_cols + cols[:, None], mask=mask_k[:, None] & mask_m[None, :], other=0.0)
    acc = tl.dot(w, x, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), input_precision=INPUT_PRECISION)

    # stage 2: the rest of this program's slice of K
    for start in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=NUM_STAGES):
        cols = start + tl.arange(0, BLOCK_K)
        mask_k = cols < k_end
        w = tl.load(weight_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_cols + cols[:, None], mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        acc = tl.dot(w, x, acc, input_precision=INPUT_PRECISION)

    # epilogue: out.T's tile; with SPLIT_K > 1 the block's last program adds the partials in K order
    offsets = offs_m[None, :] * n + offs_n[:, None]  # [BLOCK_N, BLOCK_M] into [M, N] (and into one split's partial)
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + split * BLOCK_M * n + offsets, acc, mask=mask)
        # The barrier puts every warp's partial stores before the ticket, whose release then publishes them; the
        # last taker's acquire makes every program's partial visible to its loads (from L2).
        tl.debug_barrier()
        if tl.atomic_add(tickets_ptr + block, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(partial_ptr + s * BLOCK_M * n + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(tickets_ptr + block, 0)


_launch_splitk_gemm = CachedLauncher(_splitk_gemm_kernel)
_TICKETS: dict[torch.device, torch.Tensor] = {}  # per device, zero between launches; grown, never shrunk


def split_count(n: int, k: int, config: dict) -> int:
    """K slices for an ``[n, k]`` weight: the fewest (a divisor of K's tile count) that give ``min_programs``
    programs, one slice if the row blocks alone do."""
    blocks, steps = triton.cdiv(n, config["block_n"]), triton.cdiv(k, config["block_k"])
    splits = [s for s in range(1, steps + 1) if steps % s == 0]
    return next((s for s in splits if blocks * s >= config["min_programs"]), splits[-1])


def splitk_gemm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``session_rows_gemm_b16.rows_gemm_triton``'s call (M <= 16 rows) on this kernel, with ``config``'s tiles
    (:func:`tiles`)."""
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    split_k = split_count(n, k, config)
    k_per_split = triton.cdiv(triton.cdiv(k, config["block_k"]), split_k) * config["block_k"]
    blocks = triton.cdiv(n, config["block_n"])
    tickets = _TICKETS.get(x.device)
    if tickets is None or tickets.numel() < blocks:
        tickets = _TICKETS[x.device] = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=x.device)
    partial = torch.empty(split_k, BLOCK_M, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    use_pdl = uses_programmatic_launch(x.device)
    _launch_splitk_gemm(
        (blocks, split_k, 1),
        (
            x, weight, bias if bias is not None else out, partial, tickets, out, m, n, k, x.stride(0),
            weight.stride(0), k_per_split,
        ),
        dict(
            BLOCK_M=BLOCK_M, BLOCK_N=config["block_n"], BLOCK_K=config["block_k"], SPLIT_K=split_k,
            NUM_STAGES=config["num_stages"], HAS_BIAS=bias is not None,
            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None, USE_PDL=use_pdl,
        ),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        launch_pdl=use_pdl,
    )  # fmt: skip
    return out


def tiles(block_n: int, block_k: int, min_programs: int, num_stages: int, only: tuple = ()) -> dict:
    """A variant's tiles; ``only``: the weight shapes ``(N, K)`` that take the kernel in the step (every one if
    empty), the others staying on cuBLAS."""
    return dict(
        block_n=block_n, block_k=block_k, min_programs=min_programs, num_stages=num_stages, num_warps=4, only=only
    )


def step_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict) -> torch.Tensor:
    """The step's GEMM for a variant: the kernel on the shapes ``config["only"]`` names, cuBLAS on the rest."""
    if config["only"] and tuple(weight.shape) not in config["only"]:
        return torch.nn.functional.linear(x, weight, bias)
    return splitk_gemm_triton(x, weight, bias, config)


# At 3 stages of 64 x 256 tiles a program takes about 120 KB of shared memory, one program an SM, and a first,
# uncommitted version with such tiles was far slower than cuBLAS (NOTES.md, entry 61). These keep a program's shared
# memory small, so that several share an SM. The second run (540b463,
# probes/results/session_splitk_gemm_b16_540b463.json) had 64 x 128 tiles at one stage and 264 programs ahead of
# cuBLAS on two shapes alone, the down projection and the LM head, and 36 µs a step behind with every projection on
# it; the variants below put only those two on the kernel.
DOWN, HEAD = (2048, 8192), (128256, 2048)  # bench_generate's model
VARIANTS = {  # name: (tiles or None for cuBLAS, the LM head too)
    "cublas": (None, False),
    "splitk_64x128_p264_s1": (tiles(64, 128, 264, 1), True),
    "splitk_head": (tiles(64, 128, 264, 1, only=(HEAD,)), True),
    "splitk_down_head": (tiles(64, 128, 264, 1, only=(DOWN, HEAD)), True),
    "splitk_down_head_p132": (tiles(64, 128, 132, 1, only=(DOWN, HEAD)), True),
}

REPORT: dict = {}  # written into the result JSON
COPY_BYTES = 256 * 2**20  # weight copies per shape in report.shapes: at least this much, well past the 50 MB L2


def time_shapes(model) -> list[dict]:
    """report.shapes: each distinct weight shape alone, cuBLAS and every tile variant, 16 rows, each call sequence
    replayed from a CUDA graph (``do_bench_cudagraph``: timed eagerly, the first run measured the host's launches)."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for linear in rows_probe.weight_shapes(model).values():
        rows.append(time_shape(linear.weight, generator))
        print(rows[-1], flush=True)
    return rows


def time_shape(weight: torch.Tensor, generator: torch.Generator) -> dict:
    nbytes = weight.numel() * weight.element_size()
    copies = [weight] + [weight.clone() for _ in range(max(0, -(-COPY_BYTES // nbytes) - 1))]
    x = torch.randn(16, weight.shape[1], device="cuda", dtype=weight.dtype, generator=generator)
    outs = [torch.empty(16, weight.shape[0], device="cuda", dtype=weight.dtype) for _ in copies]
    pairs = list(zip(copies, outs, strict=True))
    row = {"weight": list(weight.shape), "copies": len(copies)}
    runs = {"cublas": lambda: [torch.nn.functional.linear(x, w, out=o) for w, o in pairs]}
    for name, (config, _) in VARIANTS.items():
        if config is not None:
            row[f"{name}_splits"] = split_count(*weight.shape, config)
            runs[name] = lambda c=config: [splitk_gemm_triton(x, w, None, c, o) for w, o in pairs]
    for name, run in runs.items():
        us = 1e3 * triton.testing.do_bench_cudagraph(run, rep=200) / len(copies)
        row[f"{name}_us"] = us
        row[f"{name}_tb_per_s"] = nbytes / us / 1e6
    return row


def check_and_time_shapes(model) -> list[dict]:
    """report.bf16_check's rows (returned) and report.shapes (filled)."""
    config = next(config for config, _ in VARIANTS.values() if config is not None)
    gemm = lambda x, weight: splitk_gemm_triton(x, weight, None, config)  # noqa: E731
    rows = rows_probe.check_bf16(model, gemm, "splitk_gemm")
    REPORT["shapes"] = time_shapes(model)
    return rows


def timed_session(model, input_ids, config: dict | None, head: bool) -> dict:
    return rows_probe.timed_session(model, input_ids, config, head, step_gemm, REPORT, check_and_time_shapes)


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="cublas", batch=16, report=REPORT)


if __name__ == "__main__":
    main()
