"""Probe: a `DecodeSession`'s cold start, each variant in a fresh process with empty compile caches (issue 29).

``bench_generate`` runs its paths in one process, so a later path finds the Triton kernels an earlier one compiled
and its warm-up figure is a warm one. Here each variant runs in a process of its own whose ``TRITON_CACHE_DIR`` and
``TORCHINDUCTOR_CACHE_DIR`` are new, empty folders: nothing compiled before is found in memory or on disk. The model
is ``bench_generate``'s random-weight Llama-3.2-1B-shaped bf16 model, on the GPU before the clock starts; from there
the clock reads the seconds to each of the first ``--tokens`` tokens of one row (512 random prompt tokens): the
session's construction (patching the model), the prefill's token, then the decode steps, the first of which captures
the CUDA graph (and compiles, with ``compile=True``). Each token is read on the host before the next step. Each
Triton and Gluon kernel compile is recorded with its duration.

    python benchmarks/probes/session_cold_start.py --out DIR    # ~1 min on an H100 (the compiled variant: +20 s)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {  # DecodeSession's options per variant
    "session": {},
    "session_kernels": {"fuse_projections": True, "layer_kernels": True},
    "session_compiled_kernels": {"fuse_projections": True, "layer_kernels": True, "compile": True},
}


def child(variant: str, tokens: int) -> dict:
    """One variant, in this (fresh) process: seconds from the loaded model to each of the first ``tokens`` tokens."""
    import torch
    from bench_generate import build_config, build_model

    from flashcore.integrations.decode_session import DecodeSession

    compiles = trace_triton_compiles()
    device = torch.device("cuda")
    model = build_model(build_config(False), device)
    prompt = torch.randint(1, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    torch.cuda.synchronize()
    started = time.perf_counter()
    session = DecodeSession(model, max_cache_len=512 + tokens, batch_size=1, **VARIANTS[variant])
    built = time.perf_counter() - started
    stamps, ids = [], [int(session.prefill(prompt)[0])]
    stamps.append(time.perf_counter() - started)
    while len(stamps) < tokens:
        ids.append(int(session.decode_step()[0]))
        stamps.append(time.perf_counter() - started)
    return {
        "session_built_s": round(built, 4),
        "token_s": [round(s, 4) for s in stamps],
        "tokens": ids,
        "triton_compiles": compiles,
        "triton_compile_s": round(sum(seconds for _, seconds, _ in compiles), 3),
    }


def trace_triton_compiles() -> list:
    """Records each Triton (and Gluon) kernel compile of this process: ``[name, seconds, seconds since start]``."""
    import triton.compiler
    import triton.runtime.jit as jit

    compiles, original, origin = [], triton.compiler.compile, time.perf_counter()

    def timed(src, *args, **kwargs):
        started = time.perf_counter()
        kernel = original(src, *args, **kwargs)
        name = getattr(getattr(src, "fn", None), "__name__", type(src).__name__)
        compiles.append([name, round(time.perf_counter() - started, 3), round(started - origin, 3)])
        return kernel

    # JITFunction binds `compile` when it first builds a kernel's binder: from its module's globals (newer triton)
    # or from an import of triton.compiler's at that moment (triton 3.6).
    triton.compiler.compile = timed
    if hasattr(jit, "compile"):
        jit.compile = timed
    return compiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--tokens", type=int, default=4, help="tokens stamped per variant")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens)))
        return
    import harness

    results = {}
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as inductor_cache:
            env = {**os.environ, "TRITON_CACHE_DIR": triton_cache, "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
            command = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens)]
            started = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - started
        if done.returncode != 0:
            results[variant] = {"status": "failed", "stderr": done.stderr[-2000:]}
        else:
            results[variant] = {
                "status": "ok",
                "process_wall_s": round(wall, 2),
                **json.loads(done.stdout.splitlines()[-1]),
            }
        print(variant, json.dumps(results[variant])[:400], flush=True)
    import torch

    result = {
        "commit": harness.git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "variants": {name: VARIANTS[name] for name in results},
        "results": results,
    }
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "session_cold_start.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
