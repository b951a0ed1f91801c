"""Why HF's compiled ``generate`` on the layer kernels hung in inductor (NOTES.md, entries 55 and 56), shown on the CPU.

Inductor's IR nodes print their inputs recursively (``__str__``). A one-row decoder step with the residual adds inside
the GEMVs compiles to a chain of opaque ops in which each residual is read by two of them, so when every op returns a
new tensor the string of the last node multiplies with each layer; on the H100 inductor built such a string in
compiling HF's compiled ``generate`` of the 1B model (16 layers) and did not finish. Since entry 56 the GEMV ops write
into an ``out`` the caller allocates (``mutates_args``), a buffer inductor prints by name.

Two parts, each case in a subprocess, measuring ``str()`` of each of the last three buffers of inductor's graph just
before its code generation (characters and seconds, or ``timed_out`` past ``--timeout-s``):

- ``flashcore``: the layers of a tiny Llama (hidden 32, fused projections, layer kernels; the Triton kernels
  interpreted) compiled for one token, as flashcore runs them, at 1 to 16 layers;
- ``toy_returns`` / ``toy_out``: the same dependency pattern with two trivial custom ops per layer (a "norm" and a
  "projection plus residual"), the second either returning its output or writing it into an ``out``, at 4, 8 and
  12 layers: the two op forms alone.

    TRITON_INTERPRET=1 python benchmarks/probes/inductor_ir_str_growth.py --out \\
        benchmarks/probes/results/inductor_ir_str_growth_cpu_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch  # at module scope: the toy ops' annotations name it

CASES = [("flashcore", 1), ("flashcore", 2), ("flashcore", 4), ("flashcore", 8), ("flashcore", 16),
         ("toy_returns", 4), ("toy_returns", 8), ("toy_returns", 12), ("toy_out", 4), ("toy_out", 8),
         ("toy_out", 12)]  # fmt: skip


def one_case(mode: str, layers: int) -> None:
    """In a subprocess: compile, print one JSON line per measured buffer."""
    import torch._inductor.graph as inductor_graph

    codegen = inductor_graph.GraphLowering.codegen

    def measuring_codegen(self, *args, **kwargs):
        for buffer in self.buffers[-3:]:
            started = time.perf_counter()
            chars = len(str(buffer))
            seconds = time.perf_counter() - started
            print(json.dumps({"buffer": buffer.get_name(), "chars": chars, "seconds": round(seconds, 3)}), flush=True)
        return codegen(self, *args, **kwargs)

    inductor_graph.GraphLowering.codegen = measuring_codegen
    fn, example = _flashcore_layers(layers) if mode == "flashcore" else _toy_layers(layers, mode == "toy_out")
    with torch.inference_mode():
        torch.compile(fn, fullgraph=True, dynamic=False)(example)


def _flashcore_layers(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from flashcore.integrations.llama import apply_flashcore_to_llama

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    apply_flashcore_to_llama(model, backend="torch", layer_kernels=True, fuse_projections=True)
    position = torch.tensor([[0]])

    def layers_of_one_token(hidden):
        embeddings = model.model.rotary_emb(hidden, position_ids=position)
        for layer in model.model.layers:
            hidden = layer(hidden, position_embeddings=embeddings, attention_mask=None, position_ids=position)
        return hidden

    return layers_of_one_token, torch.randn(1, 1, config.hidden_size)


def _toy_layers(layers: int, writes_out: bool):
    @torch.library.custom_op("probe::norm", mutates_args=())
    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * 0.5

    norm.register_fake(lambda x: torch.empty_like(x))

    @torch.library.custom_op("probe::project_add", mutates_args=())
    def project_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + 2 * x

    project_add.register_fake(lambda x, residual: torch.empty_like(residual))

    @torch.library.custom_op("probe::project_add_out", mutates_args=("out",))
    def project_add_out(x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(residual + 2 * x)

    def toy(hidden):
        for _ in range(layers):
            normed = norm(hidden)  # the residual stream is read here and by the add
            if writes_out:
                out = torch.empty_like(hidden)
                project_add_out(normed, hidden, out)
                hidden = out
            else:
                hidden = project_add(normed, hidden)
        return hidden

    return toy, torch.randn(8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout-s", type=float, default=150.0)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # "mode,layers": run one case (the subprocess)
    args = parser.parse_args()
    if args.case:
        mode, layers = args.case.split(",")
        one_case(mode, int(layers))
        return
    rows = []
    for mode, layers in CASES:
        command = [sys.executable, __file__, "--out", args.out, "--case", f"{mode},{layers}"]
        row = {"mode": mode, "layers": layers}
        try:
            # Inductor's caches off: a cached graph skips the code generation this probe measures before.
            env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s, env=env)
            row["buffers"] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            row["returncode"] = done.returncode
            if done.returncode:
                row["stderr_tail"] = done.stderr[-600:]
            row["compile_s"] = round(time.perf_counter() - started, 1)
        except subprocess.TimeoutExpired:
            row["timed_out"] = args.timeout_s
        rows.append(row)
        print(row, flush=True)
        environment = {"torch": torch.__version__, "commit": os.environ.get("FLASHCORE_GIT_COMMIT", "")}
        Path(args.out).write_text(json.dumps({**environment, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
