"""Issue 29: a few-row GEMM on tensor cores under PDL against cuBLAS, in a B=16 replayed step.

At B=16 a step's projections are GEMMs of 16 rows. cuBLAS runs them at 1.54 TB/s (q/k/v, o), 2.09 (down, split-K)
and 2.62 (gate/up) in entry 52's profile, where the weights need 823 µs at 3.0 TB/s and the GEMMs took 1075.
``flashcore/kernels/triton/rows_gemm.py`` is the one-row GEMV's launch (programmatic dependent launch, the first
weight tile loaded before the wait) around a ``tl.dot`` of the rows, padded to 16, with each weight tile. This probe
times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile: the kernel has no
custom op yet) on ``bench_generate``'s model (bf16, 16 random 512-token prompts, ``max_cache_len=2048``) in one
process, the variants alternating over ``--rounds`` rounds:

- ``cublas``: the projections and the LM head on ``nn.Linear`` (cuBLAS);
- ``rows_<block_n>x<block_k>_s<stages>``: every projection and the LM head on the few-row GEMM with those tiles (4
  warps): their forwards replaced in this process for inputs of 2-16 rows (``RowsGemmForward``);
- ``rows_16x256_s4_no_head``: the default tiles, the LM head left on cuBLAS.

Before the first session on it the probe checks the kernel in bf16 on the model's shapes against fp64, beside
cuBLAS's error (``report.bf16_check``).
Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays), and the first
step where row 0's 32 greedy tokens part from ``cublas``'s (None: all equal; another summation order may round a
near-tie the other way).

    python benchmarks/probes/session_rows_gemm_b16.py --out session_rows_gemm_b16.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton.rows_gemm import MAX_ROWS, rows_gemm_triton  # noqa: E402


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
    """A linear's forward for this probe: 2-16 rows on the few-row GEMM, anything else on ``inner``. With
    ``out_features`` (a fused projection's), the output split as the fused projection splits it."""

    def __init__(self, linear, inner, config: dict) -> None:
        self.linear, self.inner, self.config = linear, inner, config
        self.weight, self.bias = linear.weight, linear.bias
        self.out_features = getattr(linear, "out_features", None)

    def __call__(self, x: torch.Tensor):
        rows = x.numel() // x.shape[-1]
        if not 2 <= rows <= MAX_ROWS:
            return self.inner(x)
        out = rows_gemm_triton(x.reshape(rows, x.shape[-1]), self.weight, self.bias, self.config)
        out = out.view(*x.shape[:-1], self.weight.shape[0])
        return out.split(self.out_features, dim=-1) if isinstance(self.out_features, list) else out


def install(model, config: dict, head: bool):
    """Puts the few-row GEMM under every projection (the fused ones, kept in a module's ``_fused_projection``, and
    the plain ``nn.Linear`` ones) and, with ``head``, the LM head; returns a function that undoes it."""
    undo = []
    for module in model.model.modules():
        fused = module.__dict__.get("_fused_projection")
        if fused is not None:
            module.__dict__["_fused_projection"] = RowsGemmForward(fused, fused, config)
            undo.append(lambda module=module, fused=fused: module.__dict__.__setitem__("_fused_projection", fused))
    linears = [module for module in model.model.modules() if isinstance(module, torch.nn.Linear)]
    for linear in linears + ([model.get_output_embeddings()] if head else []):
        forward = linear.__dict__.get("forward")
        linear.forward = RowsGemmForward(linear, linear.forward, config)
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


def check_bf16(model) -> list[dict]:
    """The kernel's and cuBLAS's worst error against fp64 on 16 bf16 rows, per distinct weight shape, in ulps of
    the largest output."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for linear in weight_shapes(model).values():
        weight = linear.weight
        x = torch.randn(16, weight.shape[1], device="cuda", dtype=weight.dtype, generator=generator)
        expected = x.double() @ weight.double().T
        ulp = torch.finfo(weight.dtype).eps * expected.abs().max().item()
        rows.append({
            "weight": list(weight.shape),
            "rows_gemm_ulps": (rows_gemm_triton(x, weight, None).double() - expected).abs().max().item() / ulp,
            "cublas_ulps": (torch.nn.functional.linear(x, weight).double() - expected).abs().max().item() / ulp,
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def timed_session(model, input_ids, config: dict | None, head: bool) -> dict:
    from flashcore.integrations.llama import apply_flashcore_to_llama

    options = dict(fuse_projections=True, layer_kernels=True)
    apply_flashcore_to_llama(model, **options)  # the fused projections and the head's forward exist from here
    if config is not None and "bf16_check" not in REPORT:
        REPORT["bf16_check"] = check_bf16(model)
    undo = install(model, config, head) if config is not None else lambda: None
    try:
        return harness.session_steps(model, input_ids, **options)
    finally:
        undo()


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="cublas", batch=16, report=REPORT)


if __name__ == "__main__":
    main()
