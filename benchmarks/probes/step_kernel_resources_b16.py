"""Issue 29: what each kernel of a B=16 replayed decode step holds on an SM, and which neighbours fit beside it.

Under programmatic dependent launch a kernel's programs start, and copy the data that does not depend on the kernel
before them, only on SMs with room left by that kernel's programs. NOTES.md (entry 85) puts the largest idle
bandwidth of a B=16 step under the q/k/v projection (12.6 MB in about 9 µs) while the attention's K/V (21 MB) stream
after it. Whether the decode kernel's programs can start beside the projection's is a matter of registers and shared
memory. This probe builds ``bench_generate``'s model (random bf16 weights), runs a ``DecodeSession``
(``fuse_projections`` and ``layer_kernels``, as ``kernels_session``) over 16 random 512-token prompts for a few
replayed steps, and lists every kernel its launchers compiled (``CachedLauncher``): registers per thread, spills,
shared memory and warps, and per kernel how many programs fit on one SM by each resource (65,536 registers, 228 KB
of shared memory of which 1 KB per program is the system's, 64 warps). Then, for the kernels in a step's order, how
many of the next kernel's programs fit on an SM that holds one program of the kernel before.

    python benchmarks/probes/step_kernel_resources_b16.py --out x.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import torch  # noqa: E402

from flashcore.kernels.launch import CachedLauncher  # noqa: E402

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_PROGRAM = 1024
WARPS_PER_SM = 64
# The chain of a B=16 step's layer, by kernel name (NOTES.md, entry 85's profile at 50032a3).
LAYER_ORDER = [
    "_tma_rows_mlp_kernel",
    "_rows_gemm_kernel",
    "_warp_specialized_decode_kernel",
    "_tma_rows_gemm_kernel",
    "_rms_norm_kernel",  # the add-and-norm
    "_tma_rows_mlp_kernel",
]


def footprint(compiled) -> dict:
    warps = compiled.metadata.num_warps
    registers = compiled.n_regs * warps * 32
    shared = compiled.metadata.shared + SHARED_RESERVED_PER_PROGRAM
    return {
        "registers_per_thread": compiled.n_regs,
        "spills": compiled.n_spills,
        "warps": warps,
        "shared_bytes": compiled.metadata.shared,
        "registers": registers,
        "programs_per_sm": min(REGISTERS_PER_SM // registers, SHARED_PER_SM // shared, WARPS_PER_SM // warps),
    }


def fits_beside(first: dict, second: dict) -> int:
    """Programs of ``second`` that fit on an SM holding one program of ``first``."""
    registers = REGISTERS_PER_SM - first["registers"]
    shared = SHARED_PER_SM - first["shared_bytes"] - SHARED_RESERVED_PER_PROGRAM
    warps = WARPS_PER_SM - first["warps"]
    return max(
        0,
        min(
            registers // second["registers"],
            shared // (second["shared_bytes"] + SHARED_RESERVED_PER_PROGRAM),
            warps // second["warps"],
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from flashcore.integrations.decode_session import DecodeSession

    device = torch.device("cuda")
    model, input_ids = harness.bench_model_and_prompts(16, device)
    with torch.inference_mode():
        session = DecodeSession(model, max_cache_len=768, batch_size=16, fuse_projections=True, layer_kernels=True)
        session.prefill(input_ids)
        for _ in range(4):
            session.decode_step()
        torch.cuda.synchronize()
    kernels = {}
    for launcher in (obj for obj in gc.get_objects() if isinstance(obj, CachedLauncher)):
        for compiled, _ in launcher._compiled.values():
            name = compiled.metadata.name
            entry = footprint(compiled)
            kernels.setdefault(name, [])
            if entry not in kernels[name]:
                kernels[name].append(entry)
    for name, entries in sorted(kernels.items()):
        for entry in entries:
            print(name, entry, flush=True)
    neighbours = []
    for first, second in zip(LAYER_ORDER, LAYER_ORDER[1:], strict=False):
        for a in kernels.get(first, []):
            for b in kernels.get(second, []):
                neighbours.append({"first": first, "second": second, "second_beside_first": fits_beside(a, b)})
                print(neighbours[-1], flush=True)
    result = {"environment": harness.environment(device), "kernels": kernels, "neighbours": neighbours}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
