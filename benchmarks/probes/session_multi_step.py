"""Issue 29: k decode steps in one CUDA graph, against one step a graph.

A session replays one graph per decode step. Inside the graph each kernel is launched with programmatic dependent
launch (PDL): it starts while the one before drains and copies its first weight tiles before it waits. Between two
replays there is no such overlap: the next replay's first kernel starts only after the last one's grid is done, and
its weight copies start then. The profile at 50032a3 (``decode_step_kernels_b16_50032a3.json``) has the first
layer's q/k/v projection advancing the step by 13.4 µs against 8.7-9.3 for the other layers'. A graph of k steps
keeps the PDL chain across k - 1 of every k step boundaries.

Variants ``steps_k`` (k = 1, 2, 4, 8): a ``DecodeSession`` (``fuse_projections`` and ``layer_kernels``, as
``bench_generate``'s ``kernels_session``) prefills, runs 3 decode steps (eager, capture, replay), then for k > 1
captures k of its steps (``session._step``, the decode step's own body) in one graph. It then runs 24 more steps, k a
replay, and times ``--replays`` steps 5 times, k a replay (µs per step: CUDA events around the replays, over the
steps). The tokens (row 0's 28: the prefill's and the 27 steps') are compared with ``steps_1``'s.

    python benchmarks/probes/session_multi_step.py --batch 16 --max-cache-len 768 --replays 40 --out x.json
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import torch  # noqa: E402

from flashcore.integrations.decode_session import DecodeSession  # noqa: E402
from flashcore.integrations.rotary_table import rotary_table_installed  # noqa: E402

VARIANTS = {f"steps_{k}": (k,) for k in (1, 2, 4, 8)}
WARMUP_STEPS = 3  # decode_step's eager run, its capture and one replay
CHECKED_STEPS = 24  # then, k a replay: a multiple of every k


def timed_session(model, input_ids, steps_per_graph: int) -> dict:
    max_cache_len, replays = harness.SESSION_SHAPE["max_cache_len"], harness.SESSION_SHAPE["replays"]
    session = DecodeSession(
        model, max_cache_len=max_cache_len, batch_size=input_ids.shape[0], fuse_projections=True, layer_kernels=True
    )
    session.prefill(input_ids)
    for _ in range(WARMUP_STEPS):
        session.decode_step()
    if steps_per_graph == 1:
        step = session.decode_step
    else:
        # decode_step's last replay wrote the next step's inputs (session._next_inputs_ready): the captured steps
        # read them and write the next ones, as decode_step's graph does.
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), rotary_table_installed(session.model, session._rotary_rows):
            for _ in range(steps_per_graph):
                session._step()

        def step():
            session.cache.count_replayed_tokens(steps_per_graph)
            graph.replay()

    for _ in range(CHECKED_STEPS // steps_per_graph):
        step()
    tokens = session.text()[0][-(WARMUP_STEPS + CHECKED_STEPS + 1) :].tolist()
    calls = replays // steps_per_graph
    timings = [1e3 * ms / steps_per_graph for ms in harness.ms_per_call_repeated(step, calls, 5)]
    return {"us_per_step": statistics.median(timings), "tokens": tokens}


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="steps_1", batch=16)


if __name__ == "__main__":
    main()
