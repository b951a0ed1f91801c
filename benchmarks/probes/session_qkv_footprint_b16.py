"""Issue 29: the q/k/v projection's footprint on an SM, and the decode kernel's programs beside it, at B=16.

``probes/step_kernel_resources_b16.py`` (ce8da59) found the q/k/v projection of a B=16 step (the Triton few-row
GEMM with the RMSNorm and the RoPE inside, 2 K slices of one 64 x 1024 tile at 8 warps, 96 programs) at 255
registers per thread with 16 spills and 160 KB of shared memory: one program fills an SM. So the decode kernel's
programs (32,768 registers, 68 KB), launched under PDL to copy K/V before their wait, find room only on the 36 SMs
the projection leaves, and the attention's 21 MB of K/V stream after the projection's 12.6 MB, where the projection
alone leaves bandwidth idle (8.7-9.3 µs of advance, 1.4 TB/s). Variants (``rows_gemm_config``'s answer for the
q/k/v shape replaced while the session is built and captured):

- ``shipped``: 2 slices of one 64 x 1024 tile, 8 warps (96 programs);
- ``k512_w4_s2``: 2 slices of two 64 x 512 tiles, 4 warps (96 programs): the tile in half the registers and shared
  memory, so that a decode program fits beside it; the second tile is loaded after the PDL wait;
- ``k512_w4_s4``: 4 slices of one 64 x 512 tile, 4 warps (192 programs; entry 68's choice before entry 71).

``DecodeSession`` with ``fuse_projections`` and ``layer_kernels``, B=16, timed as ``harness.session_steps`` does. The
report lists each variant's q/k/v kernel registers, spills and shared memory. Tokens part from ``shipped``'s at the
first steps (the slices sum in another order); the probe reports the time.

    python benchmarks/probes/session_qkv_footprint_b16.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import rows_gemm  # noqa: E402

VARIANTS = {"shipped": (None,), "k512_w4_s2": ((512, 2, 4),), "k512_w4_s4": ((512, 4, 4),)}
REPORT: dict = {}


def timed_session(model, input_ids, tile: tuple[int, int, int] | None) -> dict:
    shipped = rows_gemm.rows_gemm_config

    def config(n, k, device, norm=False, element_size=2):
        chosen = dict(shipped(n, k, device, norm, element_size))
        if norm and tile is not None:
            chosen.update(block_k=tile[0], split_k=tile[1], num_warps=tile[2])
        return chosen

    compiled_before = set(rows_gemm._launch_rows_gemm._compiled)
    with mock.patch.object(rows_gemm, "rows_gemm_config", config):
        result = harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    for key, (compiled, _) in rows_gemm._launch_rows_gemm._compiled.items():
        if key not in compiled_before:  # the kernels this variant compiled first: [registers, spills, shared, warps]
            footprint = [compiled.n_regs, compiled.n_spills, compiled.metadata.shared, compiled.metadata.num_warps]
            REPORT.setdefault(str(tile), []).append(footprint)
    return result


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16, report=REPORT)


if __name__ == "__main__":
    main()
