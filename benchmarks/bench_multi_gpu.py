"""Beyond one GPU: transformers' tensor parallelism (``tp_plan="auto"``, NCCL) and ``device_map="auto"``, each
against one GPU, in one run.

``bench_generate``'s random-weight Llama-3.2-1B-shaped model (bf16) is saved to a folder once, then loaded three
ways, each in its own process(es):

- ``one_gpu``: the whole model on the first GPU;
- ``tp``: ``torchrun --nproc-per-node 2``, ``tp_plan="auto"``: each rank holds half of the heads (16 query and 4 KV
  heads, so its ``FlashCoreCache`` holds 4) and half of the MLP, and pays two all-reduces per layer per token;
- ``device_map``: ``device_map="auto"`` over both GPUs (accelerate's balanced split, the layers in two halves):
  each layer's cache lives on its layer's GPU, one GPU works at a time, and a session steps eagerly (one CUDA graph
  captures one device's work).

Every process patches the model with ``apply_flashcore_to_llama`` (default backend) and records:

- tokens: greedy, 64 new tokens for 16 rows of 512 random prompt ids: stock ``generate`` (sdpa), flashcore's
  ``generate`` (eager) and a ``DecodeSession`` (graph-replayed where the model is on one device per process); then
  the same weights upcast to fp32, whose rounding leaves no near-ties for the split sums to flip;
- speed: a session's decode step after a 512-token prefill, at B=1 and B=16: eager steps, then (one GPU and TP)
  replayed CUDA graphs; ms per step is the median of 5 timings of 64 steps (CUDA events), tok/s = B / step.

The parent compares every process's tokens with one GPU's and writes ``bench_multi_gpu.json``.

    python benchmarks/bench_multi_gpu.py --out DIR       # 2+ GPUs; ~3 min on two H100s
    python benchmarks/bench_multi_gpu.py --dry-run --out /tmp/x   # tiny model, CPU, gloo: tests the script only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch

# Eager steps first, then the graph-replayed ones (device_map has none: one CUDA graph captures one device's work).
ROLES = ("one_gpu", "device_map", "tp", "one_gpu_graph", "tp_graph")
PROMPT_LEN, NEW_TOKENS, TOKEN_ROWS = 512, 64, 16
TIMED_STEPS, TIMINGS, WARM_STEPS = 64, 5, 8
MAX_CACHE_LEN = 1024  # prompt + warm-up + the timed steps of every timing


# ---------------------------------------------------------------------------------------------------------- workers
def load(folder: Path, role: str, dtype: torch.dtype, dry_run: bool):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "attn_implementation": "sdpa"}
    if role == "tp":
        kwargs["tp_plan"] = "auto"  # initialises torch.distributed (NCCL on GPUs, gloo on the CPU) from torchrun's env
    elif role == "device_map":
        kwargs["device_map"] = "cpu" if dry_run else "auto"
    else:
        kwargs["device_map"] = "cpu" if dry_run else "cuda:0"
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def session_tokens(model, input_ids: torch.Tensor, new_tokens: int, use_cuda_graph: bool) -> list:
    from flashcore.integrations.decode_session import DecodeSession

    session = DecodeSession(
        model,
        max_cache_len=input_ids.shape[1] + new_tokens,
        batch_size=input_ids.shape[0],
        use_cuda_graph=use_cuda_graph,
    )
    tokens = [session.prefill(input_ids).clone()]
    tokens += [session.decode_step().clone() for _ in range(new_tokens - 1)]
    return torch.stack(tokens, dim=1).tolist()


def token_runs(model, input_ids: torch.Tensor, new_tokens: int, use_cuda_graph: bool) -> dict:
    from flashcore.integrations.llama import apply_flashcore_to_llama, remove_flashcore

    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    remove_flashcore(model)
    stock = model.generate(input_ids, **kwargs)
    apply_flashcore_to_llama(model)
    flashcore = model.generate(input_ids, disable_compile=True, **kwargs)
    prompt = input_ids.shape[1]
    return {
        "stock": stock[:, prompt:].tolist(),
        "flashcore": flashcore[:, prompt:].tolist(),
        "session": session_tokens(model, input_ids, new_tokens, use_cuda_graph),
    }


def time_steps(model, input_ids: torch.Tensor, use_cuda_graph: bool) -> dict:
    """Median ms per decode step of a session over ``TIMINGS`` runs of ``TIMED_STEPS`` steps after a prefill."""
    from flashcore.integrations.decode_session import DecodeSession

    session = DecodeSession(
        model, max_cache_len=MAX_CACHE_LEN, batch_size=input_ids.shape[0], use_cuda_graph=use_cuda_graph
    )
    session.prefill(input_ids)
    for _ in range(WARM_STEPS):  # the eager warm-up and the capture happen here
        session.decode_step()
    timings = harness.ms_per_call_repeated(session.decode_step, TIMED_STEPS, TIMINGS)
    ms = statistics.median(timings)
    batch = input_ids.shape[0]
    return {"B": batch, "graph": session.use_cuda_graph, "ms_per_step": ms, "tok_per_s": batch * 1e3 / ms,
            "timings_ms": timings, "cache_kv_heads": session.cache.get_kv_cache(0)[0].shape[1]}  # fmt: skip


def worker(role: str, folder: Path, out: Path, dry_run: bool) -> None:
    """One process's share of a role (each rank's under ``torchrun``). A ``*_graph`` role replays CUDA graphs: it
    runs last and alone, so that a capture that fails or hangs costs only itself."""
    import torch.distributed as dist

    started = time.perf_counter()
    load_role = role.removesuffix("_graph")
    use_cuda_graph = role.endswith("_graph")
    stages = {}

    def stage(name: str) -> None:
        stages[name] = round(time.perf_counter() - started, 1)
        print(f"[{role} rank {os.environ.get('RANK', 0)}] {name} at {stages[name]}s", file=sys.stderr, flush=True)

    inputs = torch.tensor(json.loads((folder / "inputs.json").read_text()))
    result: dict = {"role": role, "stages": stages}
    model = load(folder, load_role, torch.float32 if dry_run else torch.bfloat16, dry_run)
    stage("loaded")
    device = model.get_input_embeddings().weight.device
    inputs = inputs[:, :PROMPT_LEN].to(device)
    result.update(device=str(device), tp_size=getattr(model, "tp_size", None) or 1)
    result["hf_device_map"] = getattr(model, "hf_device_map", None)
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name(device)
    with torch.inference_mode():
        result["bf16"] = token_runs(model, inputs, NEW_TOKENS, use_cuda_graph)
        stage("bf16 tokens")
        result["steps"] = [time_steps(model, inputs[:batch], use_cuda_graph) for batch in (1, TOKEN_ROWS)]
        stage("timed steps")
        if not use_cuda_graph:
            del model
            fp32 = load(folder, load_role, torch.float32, dry_run)
            result["fp32"] = token_runs(fp32, inputs, NEW_TOKENS, use_cuda_graph)
            stage("fp32 tokens")
    if load_role != "tp" or dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    if load_role == "tp":
        dist.barrier()


# ----------------------------------------------------------------------------------------------------------- parent
def save_model(folder: Path, dry_run: bool) -> dict:
    from bench_generate import build_config, build_model

    config = build_config(is_tiny=dry_run)
    if dry_run:
        config.num_key_value_heads = 2  # tp_size 2 must divide it
    model = build_model(config, torch.device("cpu" if dry_run else "cuda"))
    model.save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(3, config.vocab_size, (TOKEN_ROWS, PROMPT_LEN), generator=generator)
    (folder / "inputs.json").write_text(json.dumps(inputs.tolist()))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str))},
            "weight_bytes": weight_bytes}  # fmt: skip


def run_role(role: str, folder: Path, work: Path, log_dir: Path, dry_run: bool, timeout_s: float) -> dict:
    out = work / f"{role}.json"
    script = [str(Path(__file__).resolve()), "--worker", role, "--folder", str(folder), "--worker-out", str(out)]
    script += ["--dry-run"] if dry_run else []
    if role.startswith("tp"):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script]
    else:
        command = [sys.executable, *script]
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared GPUs)
    if role.startswith("one_gpu"):
        env["CUDA_VISIBLE_DEVICES"] = "0"
    started = time.perf_counter()
    log_path = log_dir / f"bench_multi_gpu_{role}.log"
    with open(log_path, "w") as log_file:
        try:
            returncode = subprocess.run(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout_s)
            returncode = returncode.returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    wall_s = round(time.perf_counter() - started, 1)
    if returncode != 0 or not out.exists():
        tail = log_path.read_text()[-6000:]
        harness.log(tail)
        return {"role": role, "status": "error", "returncode": returncode, "log_tail": tail, "wall_s": wall_s}
    result = json.loads(out.read_text())
    result.update(status="ok", wall_s=wall_s)
    return result


def compare(tokens: list, reference: list) -> dict:
    first = []
    for row, ref in zip(tokens, reference, strict=True):
        diff = [index for index, (a, b) in enumerate(zip(row, ref, strict=True)) if a != b]
        first.append(diff[0] if diff else None)
    return {"equal": tokens == reference, "rows_equal": sum(f is None for f in first), "rows": len(first),
            "first_difference": first}  # fmt: skip


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="result folder (default: $OUT, else benchmarks/results)")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (gloo): checks the script only")
    parser.add_argument("--role-timeout-s", type=float, default=150.0, help="per role; half for a graph role")
    parser.add_argument("--worker", choices=ROLES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, Path(args.folder), Path(args.worker_out), args.dry_run)
        return {}
    if not args.dry_run and torch.cuda.device_count() < 2:
        raise SystemExit("bench_multi_gpu.py needs two CUDA GPUs (use --dry-run to test the script on the CPU)")
    started = time.perf_counter()
    settings = {"dry_run": args.dry_run, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "rows": TOKEN_ROWS,
                "timed_steps": TIMED_STEPS, "timings": TIMINGS, "gpus": torch.cuda.device_count()}  # fmt: skip
    device = torch.device("cpu" if args.dry_run else "cuda")
    out_dir = harness.resolve_out_dir(args.out)
    json_path = out_dir / "bench_multi_gpu.json"
    payload = {"benchmark": "bench_multi_gpu", "status": "running", "environment": harness.environment(device),
               "settings": settings, "roles": {}}  # fmt: skip
    roles = [role for role in ROLES if not (args.dry_run and role.endswith("_graph"))]  # no CUDA graphs on the CPU
    with tempfile.TemporaryDirectory() as tmp:
        folder, work = Path(tmp) / "model", Path(tmp)
        payload["model"] = save_model(folder, args.dry_run)
        torch.cuda.empty_cache()
        for role in roles:
            harness.log(f"[{role}]  (t={time.perf_counter() - started:.0f}s)")
            timeout_s = args.role_timeout_s / (2 if role.endswith("_graph") else 1)
            payload["roles"][role] = run_role(role, folder, work, out_dir, args.dry_run, timeout_s)
            harness.write_json(json_path, payload)
    comparisons = {}
    for role in roles[1:]:
        reference = payload["roles"]["one_gpu"]
        result = payload["roles"][role]
        if result["status"] != "ok" or reference["status"] != "ok":
            continue
        dtypes = ("bf16",) if role.endswith("_graph") else ("bf16", "fp32")
        comparisons[role] = {
            f"{dtype}_{path}": compare(result[dtype][path], reference[dtype][path])
            for dtype in dtypes
            for path in ("stock", "flashcore", "session")
        }
    payload["tokens_vs_one_gpu"] = comparisons
    for role in roles:
        base_role = payload["roles"]["one_gpu_graph" if role.endswith("_graph") else "one_gpu"]
        one = {step["B"]: step for step in base_role.get("steps", [])}
        for step in payload["roles"][role].get("steps", []):
            if step["B"] in one:
                step["speedup_vs_one_gpu"] = one[step["B"]]["ms_per_step"] / step["ms_per_step"]
            speedup = step.get("speedup_vs_one_gpu", float("nan"))
            harness.log(f"  {role} B={step['B']} graph={step['graph']}: {step['ms_per_step']:.3f} ms/step, "
                        f"{step['tok_per_s']:.0f} tok/s, {speedup:.2f}x one GPU")  # fmt: skip
    for role, table in comparisons.items():
        for name, result in table.items():
            harness.log(f"  tokens {role} {name}: {result['rows_equal']}/{result['rows']} rows equal one GPU's")
    harness.finish_run(payload, json_path, started)
    harness.log(f"wrote {json_path}")
    return payload


if __name__ == "__main__":
    main()
