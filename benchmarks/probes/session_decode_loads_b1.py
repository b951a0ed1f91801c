"""Issue 29: the Gluon decode kernel's first K/V copies issued before its PDL wait, in a B=1 replayed step (measured
at 8ce7c0a; ``loads_first`` kept, then the switch removed).

At B=1 on the Llama-3.2-1B shape the decode kernel's programs each attend one 64-key tile (12 splits of 8 KV heads at
a capacity of 768), so the kernel is a chain of latencies: the PDL wait, the load of ``seq_lens``, the TMA copies of
the tile from HBM, the two small MMAs and the partial's store. Of these only the loads of ``q`` and the new token's
K/V need the previous kernel (the q/k/v GEMV). ``seq_lens`` and the cached prefix were written by this layer's
kernels one step earlier, so the copies can go out while the GEMV drains, and the wait then holds only the consumer
warps' loads of ``q`` and the new K/V. Predicted: a load from HBM (about 1 µs) off each of the 16 layers.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``) on
``bench_generate``'s model (bf16, a 512-token prompt, ``--max-cache-len`` and ``--replays`` as
``harness.session_probe_main`` takes them) in one process, the variants alternating over ``--rounds``:

- ``wait_first``: ``decode.LOADS_BEFORE_WAIT = False``, the kernel until now;
- ``loads_first``: ``seq_lens`` and the producer's copies before the wait;
- ``..._compiled``: with ``compile=True``;
- ``wait_first_clone``: ``wait_first``, each timed step followed by a ``.clone()`` of its token, as
  ``bench_generate`` does: what that costs a step.

Per variant: µs per replayed step, and the first step where its 32 greedy tokens part from ``wait_first``'s (None:
all equal; only the loads move).

    python benchmarks/probes/session_decode_loads_b1.py --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import decode  # noqa: E402

VARIANTS = {"wait_first": (False, False), "loads_first": (False, True)}  # name: (compile, loads before the wait)
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}
VARIANTS["wait_first_clone"] = (False, False, True)


def timed_session(model, input_ids, compile: bool, loads_first: bool, clone: bool = False) -> dict:
    default = decode.LOADS_BEFORE_WAIT
    decode.LOADS_BEFORE_WAIT = loads_first
    try:
        if not clone:
            return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
        return _session_steps_with_clone(model, input_ids, compile)
    finally:
        decode.LOADS_BEFORE_WAIT = default


def _session_steps_with_clone(model, input_ids, compile: bool) -> dict:
    """``harness.session_steps``, each timed step followed by a clone of its token."""
    from flashcore.integrations.decode_session import DecodeSession

    max_cache_len, replays = harness.SESSION_SHAPE["max_cache_len"], harness.SESSION_SHAPE["replays"]
    session = DecodeSession(
        model, max_cache_len=max_cache_len, batch_size=input_ids.shape[0], compile=compile, fuse_projections=True,
        layer_kernels=True,
    )  # fmt: skip
    tokens = [session.prefill(input_ids).clone()]
    tokens += [session.decode_step().clone() for _ in range(31)]
    timings = [1e3 * ms for ms in harness.ms_per_call_repeated(lambda: session.decode_step().clone(), replays, 5)]
    return {"us_per_step": statistics.median(timings), "tokens": torch.stack(tokens, 1)[0].tolist()}


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="wait_first")


if __name__ == "__main__":
    main()
