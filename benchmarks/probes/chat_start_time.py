"""Probe: how long the chat takes from launch to its first answer token, on the first start and on a second one.

Runs ``examples/generate.py --prompt ... --max-new-tokens 1`` as a user would (a subprocess, offline, default
model: SmolLM2-135M-Instruct's GGUF, CPU, float32) with a fresh ``FLASHCORE_CACHE_DIR``:

- ``first``: dequantises the GGUF and writes its safetensors copy into the cache folder;
- ``second``: reads that copy (``--starts`` runs of it);
- ``no_convert_cache``: ``--no-convert-cache``, the GGUF read every time (the start before the copy existed).

Each row is the time from launching the process to the first byte of the answer on stdout (one token was asked
for), plus the ``[load] ready in`` time that the chat reports itself (model and tokenizer loading only).

    python benchmarks/probes/chat_start_time.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "generate.py"
QUESTION = "What is the capital of France?"


def time_to_first_token(cache_dir: str, *flags: str) -> dict:
    """Launches the chat and reads stdout until its first byte: seconds from launch to it, and the [load] time."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(FLASHCORE_CACHE_DIR=cache_dir, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, str(SCRIPT), "--prompt", QUESTION, "--max-new-tokens", "1", *flags]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first_byte = child.stdout.read(1)
    first_token_s = time.perf_counter() - start
    stdout, stderr = child.communicate(timeout=600)
    if child.returncode != 0 or not first_byte:
        raise RuntimeError(f"{command} failed ({child.returncode}): {stderr.decode()[-2000:]}")
    ready = re.search(r"\[load\] ready in ([\d.]+)s", stderr.decode())
    return {
        "first_token_s": round(first_token_s, 2),
        "load_s": float(ready.group(1)) if ready else None,
        "wrote_copy": "wrote a safetensors copy" in stderr.decode(),
        "read_copy": "(safetensors copy of" in stderr.decode(),
        "answer_start": (first_byte + stdout).decode().strip(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for chat_start_time.json")
    parser.add_argument("--starts", type=int, default=2, help="second starts to time")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="flashcore-cache-") as cache_dir:
        for start, flags in [
            ("first", ()),
            *[("second", ())] * args.starts,
            ("no_convert_cache", ("--no-convert-cache",)),
        ]:
            row = {"start": start, **time_to_first_token(cache_dir, *flags)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    payload = dict(environment=harness.environment(torch.device("cpu")), cpu_count=os.cpu_count(), rows=rows)
    harness.write_json(harness.resolve_out_dir(args.out) / "chat_start_time.json", payload)


if __name__ == "__main__":
    main()
