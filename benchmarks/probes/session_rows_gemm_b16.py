"""Issue 29: a few-row GEMM on tensor cores under PDL against cuBLAS, in a B=16 replayed step.

At B=16 a step's projections are GEMMs of 16 rows. cuBLAS runs them at 1.54 TB/s (q/k/v, o), 2.09 (down, split-K)
and 2.62 (gate/up) in entry 52's profile, where the weights need 823 µs at 3.0 TB/s and the GEMMs took 1075.
The kernel below (``_rows_gemm_kernel``) is the one-row GEMV's launch (``flashcore/kernels/triton/gemv.py``:
programmatic dependent launch, the first weight tile loaded before the wait, the dependents released right after
it) around a ``tl.dot`` of the rows, padded to 16, with each weight tile: each program owns ``block_n`` outputs of
every row and walks K in ``block_k`` steps, Triton's pipeliner keeping ``num_stages`` tiles in flight; fp32
accumulation, one rounding. It was measured slower than cuBLAS here (entry 57) and lives in this probe, not in
flashcore (it was ``flashcore/kernels/triton/rows_gemm.py`` at 761283c, tested there against fp64). This probe
times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile: the kernel has no
custom op) on ``bench_generate``'s model (bf16, 16 random 512-token prompts, ``max_cache_len=2048``) in one
process, the variants alternating over ``--rounds`` rounds:

- ``cublas``: the projections and the LM head on ``nn.Linear`` (cuBLAS);
- ``rows_<block_n>x<block_k>_s<stages>``: every projection and the LM head on the few-row GEMM with those tiles (4
  warps): their forwards replaced in this process for inputs of 2-16 rows (``RowsGemmForward``);
- ``rows_16x256_s4_no_head``: the default tiles, the LM head left on cuBLAS.

Before the first variant that runs the kernel, the probe checks it in bf16 on the model's weight shapes against
fp64, beside cuBLAS's error (``report.bf16_check``).
Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays), and the first
step where row 0's 32 greedy tokens part from ``cublas``'s (None: all equal; another summation order may round a
near-tie the other way).

    python benchmarks/probes/session_rows_gemm_b16.py --out session_rows_gemm_b16.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch  # noqa: E402

BLOCK_M = 16  # the rows, padded: tl.dot's smallest tile
MAX_ROWS = BLOCK_M


@triton.jit
def _rows_gemm_kernel(
    x_ptr,  # [M, K], unit stride along K
    weight_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N]; read only when HAS_BIAS
    out_ptr,  # [M, N], contiguous
    m,
    n,
    k,
    stride_x_m,
    stride_weight_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs; None: tl.dot's default (fp16/bf16)
    USE_PDL: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < m, offs_n < n
    weight_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_weight_n
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x_m

    # stage 1: the first weight tile, loaded while the kernel before may still run
    mask_k = offs_k < k
    w = tl.load(weight_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    if USE_PDL:
        gdc_wait()  # x comes from the kernel before
        gdc_launch_dependents()
    x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), input_precision=INPUT_PRECISION)

    # stage 2: the rest of K
    for start in tl.range(BLOCK_K, k, BLOCK_K, num_stages=NUM_STAGES):
        cols = start + offs_k
        mask_k = cols < k
        w = tl.load(weight_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_rows + cols[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)

    # epilogue
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * n + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_launch_rows_gemm = CachedLauncher(_rows_gemm_kernel)


def rows_gemm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: dict,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` (M <= 16) with unit stride along K, ``weight`` ``[N, K]`` with unit stride along K, ``bias``
    ``[N]`` or None; returns ``out`` (``[M, N]`` contiguous of ``x``'s dtype; a new one if None), with ``config``'s
    tiles (:func:`tiles`)."""
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    use_pdl = uses_programmatic_launch(x.device)
    _launch_rows_gemm(
        (triton.cdiv(n, config["block_n"]), 1, 1),
        (x, weight, bias if bias is not None else out, out, m, n, k, x.stride(0), weight.stride(0)),
        dict(
            BLOCK_M=BLOCK_M, BLOCK_N=config["block_n"], BLOCK_K=config["block_k"], NUM_STAGES=config["num_stages"],
            HAS_BIAS=bias is not None, INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
            USE_PDL=use_pdl,
        ),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        launch_pdl=use_pdl,
    )  # fmt: skip
    return out


def tiles(block_n: int, block_k: int, num_stages: int) -> dict:
    return dict(block_n=block_n, block_k=block_k, num_warps=4, num_stages=num_stages)


VARIANTS = {  # name: (tiles or None for cuBLAS, the LM head too)
    "cublas": (None, False),
    "rows_16x256_s4": (tiles(16, 256, 4), True),
    "rows_32x128_s4": (tiles(32, 128, 4), True),
    "rows_16x512_s3": (tiles(16, 512, 3), True),
    "rows_16x256_s4_no_head": (tiles(16, 256, 4), False),
}


REPORT: dict = {}  # written into the result JSON


class RowsGemmForward:
    """A linear's forward for this probe: 2-16 rows on the few-row GEMM (``gemm``, by default this probe's), anything
    else on ``inner``. With ``out_features`` (a fused projection's), the output split as the fused projection splits
    it."""

    def __init__(self, linear, inner, config: dict, gemm=None) -> None:
        self.linear, self.inner, self.config = linear, inner, config
        self.gemm = gemm or rows_gemm_triton
        self.weight, self.bias = linear.weight, linear.bias
        self.out_features = getattr(linear, "out_features", None)

    def __call__(self, x: torch.Tensor):
        rows = x.numel() // x.shape[-1]
        if not 2 <= rows <= MAX_ROWS:
            return self.inner(x)
        out = self.gemm(x.reshape(rows, x.shape[-1]), self.weight, self.bias, self.config)
        out = out.view(*x.shape[:-1], self.weight.shape[0])
        return out.split(self.out_features, dim=-1) if isinstance(self.out_features, list) else out


def install(model, config: dict, head: bool, gemm=None):
    """Puts the few-row GEMM (``gemm``, by default this probe's) under every projection (the fused ones, kept in a
    module's ``_fused_projection``, and the plain ``nn.Linear`` ones) and, with ``head``, the LM head; returns a
    function that undoes it."""
    undo = []
    for module in model.model.modules():
        fused = module.__dict__.get("_fused_projection")
        if fused is not None:
            module.__dict__["_fused_projection"] = RowsGemmForward(fused, fused, config, gemm)
            undo.append(lambda module=module, fused=fused: module.__dict__.__setitem__("_fused_projection", fused))
    linears = [module for module in model.model.modules() if isinstance(module, torch.nn.Linear)]
    for linear in linears + ([model.get_output_embeddings()] if head else []):
        forward = linear.__dict__.get("forward")
        linear.forward = RowsGemmForward(linear, linear.forward, config, gemm)
        undo.append(lambda linear=linear, forward=forward: _restore_forward(linear, forward))
    return lambda: [step() for step in reversed(undo)]


def _restore_forward(linear: torch.nn.Module, forward) -> None:
    if forward is None:
        del linear.forward
    else:
        linear.forward = forward


def weight_shapes(model) -> dict:
    """One module per distinct projection weight shape of the step (the fused ones, o, down) and the LM head."""
    found = [
        module.__dict__["_fused_projection"]
        for module in model.model.modules()
        if "_fused_projection" in module.__dict__
    ]
    found += [module for module in model.model.modules() if isinstance(module, torch.nn.Linear)]
    found.append(model.get_output_embeddings())
    return {tuple(module.weight.shape): module for module in found}


def check_bf16(model, gemm=None, name: str = "rows_gemm") -> list[dict]:
    """``gemm(x, weight)``'s (by default this probe's kernel with the first variant's tiles) and cuBLAS's worst error
    against fp64 on 16 bf16 rows, per distinct weight shape, in ulps of the largest output (as ``<name>_ulps`` and
    ``cublas_ulps``)."""
    if gemm is None:
        config = next(config for config, _ in VARIANTS.values() if config is not None)
        gemm = lambda x, weight: rows_gemm_triton(x, weight, None, config)  # noqa: E731
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for linear in weight_shapes(model).values():
        weight = linear.weight
        x = torch.randn(16, weight.shape[1], device="cuda", dtype=weight.dtype, generator=generator)
        expected = x.double() @ weight.double().T
        ulp = torch.finfo(weight.dtype).eps * expected.abs().max().item()
        rows.append({
            "weight": list(weight.shape),
            f"{name}_ulps": (gemm(x, weight).double() - expected).abs().max().item() / ulp,
            "cublas_ulps": (torch.nn.functional.linear(x, weight).double() - expected).abs().max().item() / ulp,
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def timed_session(
    model, input_ids, config: dict | None, head: bool, gemm=None, report: dict | None = None, check=check_bf16
) -> dict:
    """One variant's session steps, with ``gemm`` (by default this probe's kernel) under the projections for
    ``config``'s tiles (cuBLAS for None); before the first variant that runs it, ``check(model)`` goes into
    ``report["bf16_check"]`` (by default this probe's report)."""
    from flashcore.integrations.llama import apply_flashcore_to_llama

    report = REPORT if report is None else report
    options = dict(fuse_projections=True, layer_kernels=True)
    apply_flashcore_to_llama(model, **options)  # the fused projections and the head's forward exist from here
    if config is not None and "bf16_check" not in report:
        report["bf16_check"] = check(model)
    undo = install(model, config, head, gemm) if config is not None else lambda: None
    try:
        return harness.session_steps(model, input_ids, **options)
    finally:
        undo()


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="cublas", batch=16, report=REPORT)


if __name__ == "__main__":
    main()
