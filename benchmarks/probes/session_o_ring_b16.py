"""Issue 29: the o projection's ring and the decode kernel's stages beside two decode programs an SM, B=16.

Since 7eeab90 the Gluon decode kernel runs a B=16 step's attention on the Llama-3.2-1B shape in two KV splits, two
programs to most SMs (``configs.gluon_decode_kv_splits``, NOTES.md entry 86). Two decode programs hold about 132 KB
of an SM's shared memory, so an o projection program (the TMA few-row GEMM, a ring of 6 stages of 20 KB: 120 KB)
no longer fits beside them, and starts, and copies its first weight tiles, only as they end. With a ring of 4
(80 KB) it fits. And each decode program now streams half a row through 2 stages.

Variants: ``shipped``; ``o_ring_4`` and ``o_ring_3``, the o projection's ring (the TMA GEMM's ``num_stages`` for
a square weight, which only the o projection has here); ``decode_stages_3``, the decode kernel's stages
(``GluonDecodeConfig.num_stages``). ``DecodeSession`` with ``fuse_projections`` and ``layer_kernels``
(``bench_generate``'s ``kernels_session``), timed as ``harness.session_steps`` does.

    python benchmarks/probes/session_o_ring_b16.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import decode, rows_gemm  # noqa: E402

VARIANTS = {"shipped": (0, 0), "o_ring_4": (4, 0), "o_ring_3": (3, 0), "decode_stages_3": (0, 3)}


def timed_session(model, input_ids, o_ring: int, decode_stages: int) -> dict:
    shipped_gemm = rows_gemm.tma_rows_gemm

    def o_on_its_ring(x, weight, bias, **options):
        if weight.shape[0] == weight.shape[1]:
            options["num_stages"] = o_ring
        return shipped_gemm(x, weight, bias, **options)

    patches = contextlib.ExitStack()
    with patches:
        if o_ring:
            patches.enter_context(mock.patch.object(rows_gemm, "tma_rows_gemm", o_on_its_ring))
        if decode_stages:
            config = dataclasses.replace(decode.CONFIG, num_stages=decode_stages)
            patches.enter_context(mock.patch.object(decode, "CONFIG", config))
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
