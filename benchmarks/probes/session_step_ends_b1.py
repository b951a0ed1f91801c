"""Issue 29: a B=1 step's two ends, before and after the rotary table and the one-launch step end.

A replayed B=1 step spent about 9 µs (compiled) to 17 µs (replayed) before its first GEMV on HF's rotary embedding
and the token's embedding, and 11 to 20 µs after the LM head on the pick's second pass and the step's bookkeeping
(``decode_step_kernels.py`` at 04b0820 and 2c920f3). A session now gathers cos and sin from a table the model's rotary
module computed once (``integrations/rotary_table.py``) and ends its step in one launch (``integrations/step_end.py``;
at 5a851f4 the pick's first pass was still torch's or inductor's max before it, ``results/..._5a851f4.json``).
This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``) on
``bench_generate``'s model (bf16, a 512-token prompt; ``max_cache_len=2048`` and 100 replays a timing, or
``--max-cache-len 768 --replays 40``, ``bench_generate``'s capacity) in one process, the variants alternating over
``--rounds``:

- ``separate``: the step as before: HF's rotary module on every step, and the pick's second pass, the token's copy,
  the position and cache-position adds and the text's append as separate ops;
- ``table_one_launch``: the session's default now;
- ``..._compiled``: with ``compile=True``.

Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays), and the first
step where its 32 greedy tokens part from ``separate``'s (None: all equal).

    python benchmarks/probes/session_step_ends_b1.py --out session_step_ends_b1.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.integrations import decode_session  # noqa: E402

VARIANTS = {"separate": (False, False), "table_one_launch": (False, True)}  # name: (compile, new ends)
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}


def separate_step(self) -> None:
    """The decode step before the one-launch end: the pick, then each update as its own op."""
    logits = self._next_logits(self.token, self._position, self._cache_position)
    self.token.copy_(self._select(logits))
    self._position.add_(1)
    self._cache_position.add_(1)
    self._append_history(self.token[:, None], 1)


def timed_session(model, input_ids, compile: bool, new_ends: bool) -> dict:
    table_for, step = decode_session.rotary_table_for, decode_session.DecodeSession._step_eager
    if not new_ends:
        decode_session.rotary_table_for = lambda model, num_positions: None
        decode_session.DecodeSession._step_eager = separate_step
    try:
        return harness.session_steps(model, input_ids, compile=compile, fuse_projections=True, layer_kernels=True)
    finally:
        decode_session.rotary_table_for, decode_session.DecodeSession._step_eager = table_for, step


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="separate")


if __name__ == "__main__":
    main()
