"""Issue 29: the q/k/v projection's norm from sums of squares the MLP before it wrote, in a B=16 replayed step.

``probes/session_qkv_bounds_b16.py`` (entry 89) found that taking the norm's sums of squares out of the q/k/v
projection (each row scaled by 1) shortens a B=16 step by 31.8 µs, 2 µs a layer: after its PDL wait each of the 96
programs reads all 16 rows of x (64 KB; 6 MB of L2 reads at once across the grid) and reduces them before its MMA,
where its own slice is 32 KB. Here the kernel that wrote x, the MLP's one launch (its down projection's epilogue,
where the last program of each 64-column block adds the split-K slices and the residual), also writes each row's sum
of squares over its block's 64 rounded outputs, ``[32, 16]`` fp32; the next layer's q/k/v programs read those 2 KB
and add the 32 blocks in order instead. Layer 0's q/k/v, after the embedding, sums as shipped.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts) in one process, the variants alternating over
``--rounds`` rounds; ``tma_rows_mlp`` and ``rows_gemm_triton`` are wrapped while the session is built and captured
(each is called once a layer, in layer order; one buffer serves every layer, since the next MLP writes it only after
the q/k/v projection that reads it):

- ``shipped``;
- ``squares``: the sums from the MLP before.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s (the squares
are added in another order, so a norm may round the other way: they may part); and the largest relative error of
the sums the eager warm-up steps read, against x's own squares summed by torch.

It runs at eca95de only: the kernels' ``squares`` and ``norm_squares`` were taken out after it (entry 89).

    python benchmarks/probes/session_norm_squares_b16.py --out session_norm_squares_b16.json --max-cache-len 768
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import rows_mlp  # noqa: E402
from flashcore.kernels.triton import rows_gemm  # noqa: E402

VARIANTS = {"shipped": (False,), "squares": (True,)}  # name: (the q/k/v norm from the MLP's squares,)
REPORT = {"squares_max_relative_error": 0.0}  # of the sums the eager warm-up steps read, against x's own


def timed_session(model, input_ids, squares: bool) -> dict:
    """``harness.session_steps``, with the two kernels wrapped while the session is built and captured."""
    from flashcore.integrations.decode_session import DecodeSession

    max_cache_len, replays = harness.SESSION_SHAPE["max_cache_len"], harness.SESSION_SHAPE["replays"]
    gemm, mlp = rows_gemm.rows_gemm_triton, rows_mlp.tma_rows_mlp
    layers = model.config.num_hidden_layers
    buffer = torch.zeros(model.config.hidden_size // rows_mlp.BLOCK_N, rows_mlp.MAX_ROWS, device=input_ids.device)
    calls = [0]

    def qkv(x, weight, bias, **kwargs):
        if kwargs.get("norm_weight") is not None and kwargs.get("cos") is not None:
            if calls[0] % layers:
                kwargs["norm_squares"] = buffer
                if not torch.cuda.is_current_stream_capturing():  # the eager warm-up step: check the sums
                    expected = x.float().pow(2).sum(-1)
                    error = ((buffer.sum(0)[: x.shape[0]] - expected).abs() / expected).max().item()
                    REPORT["squares_max_relative_error"] = max(REPORT["squares_max_relative_error"], error)
            calls[0] += 1
        return gemm(x, weight, bias, **kwargs)

    def mlp_with_squares(*args, **kwargs):
        return mlp(*args, **kwargs, squares=buffer)

    session = DecodeSession(
        model, max_cache_len=max_cache_len, batch_size=input_ids.shape[0], fuse_projections=True, layer_kernels=True
    )
    if squares:
        rows_gemm.rows_gemm_triton, rows_mlp.tma_rows_mlp = qkv, mlp_with_squares
    try:
        session.prefill(input_ids)
        for _ in range(31):
            session.decode_step()
    finally:
        rows_gemm.rows_gemm_triton, rows_mlp.tma_rows_mlp = gemm, mlp
    tokens = session.text()[0][-32:].tolist()
    timings = [1e3 * ms for ms in harness.ms_per_call_repeated(session.decode_step, replays, 5)]
    return {"us_per_step": statistics.median(timings), "tokens": tokens}


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16, report=REPORT)


if __name__ == "__main__":
    main()
