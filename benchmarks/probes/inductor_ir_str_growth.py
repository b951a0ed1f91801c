"""Why HF's compiled ``generate`` on the layer kernels hung in inductor (NOTES.md, entry 55), shown on the CPU.

With the residual adds inside the GEMVs, a one-row decoder step compiles to an unbroken chain of opaque ops, each
layer reading the residual stream twice, and inductor's IR nodes print their inputs recursively: the string of the
last node grows with each layer. On the H100 inductor built such a string in compiling the 1B model (16 layers) and
did not finish. Under ``torch.compile`` flashcore now leaves the adds to inductor (``_split_residual`` in
``integrations/llama_forward_fork.py``), whose pointwise nodes print their inputs by name.

This probe compiles the layers of a tiny Llama (hidden 32, fused projections, layer kernels; the Triton kernels
interpreted) for one token, in a subprocess per case, and measures ``str()`` of each of the last three buffers of
inductor's graph just before its code generation: characters and seconds, or ``timed_out`` past ``--timeout-s``.
``fold``: the adds inside the GEMVs under compile too (``_split_residual`` replaced in that process); ``inductor``:
as flashcore runs.

    TRITON_INTERPRET=1 python benchmarks/probes/inductor_ir_str_growth.py --out \\
        benchmarks/probes/results/inductor_ir_str_growth_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CASES = [("inductor", 1), ("inductor", 2), ("inductor", 4), ("inductor", 8), ("inductor", 16), ("fold", 1), ("fold", 2),
         ("fold", 3)]  # fmt: skip


def one_case(mode: str, layers: int) -> None:
    """In a subprocess: compile, print one JSON line per measured buffer."""
    import torch
    import torch._inductor.graph as inductor_graph
    from transformers import LlamaConfig, LlamaForCausalLM

    from flashcore.integrations import llama_forward_fork
    from flashcore.integrations.llama import apply_flashcore_to_llama

    if mode == "fold":
        llama_forward_fork._split_residual = lambda residual: (residual, None)
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

    codegen = inductor_graph.GraphLowering.codegen

    def measuring_codegen(self, *args, **kwargs):
        for buffer in self.buffers[-3:]:
            started = time.perf_counter()
            chars = len(str(buffer))
            seconds = time.perf_counter() - started
            print(json.dumps({"buffer": buffer.get_name(), "chars": chars, "seconds": round(seconds, 3)}), flush=True)
        return codegen(self, *args, **kwargs)

    inductor_graph.GraphLowering.codegen = measuring_codegen
    with torch.inference_mode():
        torch.compile(layers_of_one_token, fullgraph=True, dynamic=False)(torch.randn(1, 1, config.hidden_size))


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
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s, env=env)
            row["buffers"] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            row["returncode"] = done.returncode
        except subprocess.TimeoutExpired:
            row["timed_out"] = args.timeout_s
        rows.append(row)
        print(row, flush=True)
        Path(args.out).write_text(json.dumps({"torch": _torch_version(), "rows": rows}, indent=1) + "\n")


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
