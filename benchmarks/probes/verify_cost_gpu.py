"""Probe: what does one captured verify step of k + 1 tokens cost against one captured decode step, on the GPU?

Issue 28 asks for the cost of ``DecodeSession``'s speculative verify step (prompt lookup's k drafts plus the current
token in one forward, ``S_q = k + 1``, with acceptance, rollback and the next drafts on the device) against a decode
step, for k in {2, 4, 8}, so that the GPU speed-up follows from an acceptance measured elsewhere (on the real model:
``prompt_lookup_cpu.py``). Acceptance depends on the weights; this model has random ones.

Model: ``bench_generate``'s (the Llama-3.2-1B shape, bf16, random weights), prompt 512 tokens that repeat one
16-token phrase (so prompt lookup always finds a draft and the verify step always runs), B 1 and 16. For each B:

- ``decode``: the session's captured decode step (``decode_step``), replayed;
- ``verify k``: the captured verify step (``speculative_step``'s), replayed on its own, which verifies the drafts
  the previous replay proposed;
- ``plain_propose k``: the captured plain step that also proposes the next drafts (the last step of a pause after
  failed drafts, and every step while no row has a draft).

Each figure is the median over ``--trials`` of CUDA-event timings of ``--replays`` back-to-back replays (the
device's time per step; the context grows by the tokens kept, from 512 up to a few hundred more); for each k the
decode, verify and proposing plain steps are timed in turn within each trial, and the ratios use the decode time
measured next to them. Then the host's
view: the wall time of one ``speculative_step(k)`` call (replay plus its one host read) against one ``decode_step``
followed by reading its token, medians over ``--calls`` calls.

    python benchmarks/probes/verify_cost_gpu.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402
from bench_generate import build_config, build_model  # noqa: E402

from flashcore.integrations.decode_session import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM  # noqa: E402

PHRASE_LEN = 16


def replay_ms(graph, replays: int, trials: int) -> float:
    """Median over ``trials`` of the device's ms per replay of ``graph`` (CUDA events around ``replays`` replays)."""
    return statistics.median(harness.ms_per_call_repeated(graph.replay, replays, trials))


def new_session(model, batch: int, prompt: torch.Tensor, capacity: int):
    from flashcore.integrations.decode_session import DecodeSession

    session = DecodeSession(model, max_cache_len=capacity, batch_size=batch)
    session.prefill(prompt)
    return session


def main(args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    config = build_config(is_tiny=False)
    model = build_model(config, device)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        phrase = torch.randint(0, config.vocab_size, (batch, PHRASE_LEN), generator=generator)
        prompt = phrase.repeat(1, args.prompt_len // PHRASE_LEN).to(device)
        capacity = args.prompt_len + args.replays * (args.trials + 4) * (max(args.drafts) + 1) + 64
        session = new_session(model, batch, prompt, capacity)
        for _ in range(3):  # eager warm-up, capture, one replay
            session.decode_step()
        decode_session = session  # kept alive: its decode graph writes its cache
        decode_graph = decode_session._graphs[("decode",)][0]
        row = {"batch": batch, "decode_ms": replay_ms(decode_graph, args.replays, args.trials)}
        host = {"decode": []}
        for _ in range(args.calls):
            started = time.perf_counter()
            session.decode_step().tolist()
            host["decode"].append(1e3 * (time.perf_counter() - started))
        row["decode_call_ms"] = statistics.median(host["decode"])
        for num_draft in args.drafts:
            session = new_session(model, batch, prompt, capacity)
            key = ("verify", num_draft, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM)
            kept = []
            plain_key = ("plain", num_draft, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM)
            for _ in range(200):  # until the verify step and the proposing plain step both replay graphs
                if key in session.captured_steps and plain_key in session.captured_steps:
                    break
                tokens, counts = session.speculative_step(num_draft)
            calls = []
            for _ in range(args.calls):
                started = time.perf_counter()
                tokens, counts = session.speculative_step(num_draft)
                counts.tolist()
                calls.append(1e3 * (time.perf_counter() - started))
                if tokens.shape[1] > 1:
                    kept += (counts - 1).tolist()
            # Decode, verify and the proposing plain step timed in turn, trial by trial: a drift of the GPU's clocks
            # reaches all three (an earlier run timed decode once per B and read the later k's as slower).
            graphs = {"decode": decode_graph, "verify": session._graphs[key][0]}
            if plain_key in session.captured_steps:
                graphs["plain_propose"] = session._graphs[plain_key][0]
            timed = {name: [] for name in graphs}
            for _ in range(args.trials):
                for name, graph in graphs.items():
                    timed[name].append(replay_ms(graph, args.replays, 1))
            decode_ms = statistics.median(timed["decode"])
            row[f"decode_next_to_{num_draft}_ms"] = decode_ms
            row[f"verify_{num_draft}_ms"] = verify_ms = statistics.median(timed["verify"])
            row[f"verify_{num_draft}_over_decode"] = verify_ms / decode_ms
            row[f"verify_{num_draft}_call_ms"] = statistics.median(calls)
            row[f"verify_{num_draft}_mean_kept_random_weights"] = statistics.mean(kept) if kept else None
            if "plain_propose" in timed:
                plain_ms = statistics.median(timed["plain_propose"])
                row[f"plain_propose_{num_draft}_ms"] = plain_ms
                row[f"plain_propose_{num_draft}_over_decode"] = plain_ms / decode_ms
            call_ms = row[f"verify_{num_draft}_call_ms"]
            print(
                f"B={batch:<3} k={num_draft}: verify {verify_ms:.3f} ms = {verify_ms / decode_ms:.3f}x decode "
                f"({decode_ms:.3f} ms, timed in turn with it); per call {call_ms:.3f} ms against "
                f"{row['decode_call_ms']:.3f} ms; a plain step that proposes "
                f"{row.get(f'plain_propose_{num_draft}_over_decode', float('nan')):.3f}x decode",
                flush=True,
            )
        rows.append(row)
    payload = {
        "question": __doc__.split("\n\n")[0],
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "git_commit": os.environ.get("FLASHCORE_GIT_COMMIT", "unknown"),
        "settings": vars(args),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost_gpu.json").write_text(json.dumps(payload, indent=1))
    print("wrote", out / "verify_cost_gpu.json")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the JSON")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--drafts", type=lambda text: [int(k) for k in text.split(",")], default=[2, 4, 8])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--replays", type=int, default=20, help="replays per timing")
    parser.add_argument("--trials", type=int, default=7, help="timings per figure")
    parser.add_argument("--calls", type=int, default=30, help="timed calls per host-side figure")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
