"""Probe: does the bound launch change an eager decode call's device time?

The Gluon decode kernel's eager calls replay a ``BoundLaunch`` (the same compiled kernel, arguments encoded once)
instead of going through ``CachedLauncher``. The kernel is the same, so the device time should be too. This times
both paths on the rows of ``bench_attention`` whose eager device time moved after the change, and on two that did
not, with ``harness.CudaTimer.eager_us`` (cold L2, the device kept behind the host), the two paths alternating over
``--rounds`` rounds; medians of the rounds' medians.

    python benchmarks/probes/eager_device_time_bound.py --out DIR
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

import flashcore  # noqa: E402
from flashcore import kernels  # noqa: E402
from flashcore.kernels.gluon_sm90 import decode as gluon_decode  # noqa: E402

# (label, B, L, H_q, H_kv, D): the three rows that moved, then two that did not.
ROWS = [
    ("gqa32/8 B1 L1024", 1, 1024, 32, 8, 128),
    ("gqa32/8 B8 L1024", 8, 1024, 32, 8, 128),
    ("smol9/3 B8 L4096", 8, 4096, 9, 3, 64),
    ("gqa32/8 B1 L4096", 1, 4096, 32, 8, 128),
    ("smol9/3 B1 L4096", 1, 4096, 9, 3, 64),
]


def measure(label, batch, length, num_q_heads, num_kv_heads, head_dim, timer, generator, rounds) -> dict:
    device, dtype = torch.device("cuda"), torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    q = randn(batch, num_q_heads, 1, head_dim)
    k, v = randn(batch, num_kv_heads, 1, head_dim), randn(batch, num_kv_heads, 1, head_dim)
    cache = flashcore.allocate_kv_cache(batch, num_kv_heads, length + 64, head_dim, dtype=dtype, device=device)
    cache[0].normal_()
    cache[1].normal_()
    call = kernels.KernelCall(q, k, v, *cache, None, True, head_dim**-0.5, 0)
    assert kernels.select_kernel(call, "triton") is gluon_decode

    def reset():
        cache[2].fill_(length)

    def unbound():
        out = q.new_empty(q.shape)
        gluon_decode._launch(call, out, True, None)
        return out

    sides = {"bound": lambda: gluon_decode.run(call), "unbound": unbound}
    outputs = []
    for name in ("unbound", "bound", "bound"):  # the first bound call binds, the second replays
        reset()
        outputs.append(sides[name]())
    assert torch.equal(outputs[0], outputs[2]), "the bound launch computed other bits"
    medians = {name: [] for name in sides}
    for round_index in range(rounds):
        for name in sides if round_index % 2 == 0 else reversed(sides):
            medians[name].append(timer.eager_us(sides[name], reset))
    row = dict(row=label)
    row.update({f"{name}_eager_us": round(statistics.median(values), 2) for name, values in medians.items()})
    row["bound_over_unbound"] = round(row["bound_eager_us"] / row["unbound_eager_us"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for eager_device_time_bound.json")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--eager-iters", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device="cpu").manual_seed(0)
    timer = harness.CudaTimer(device, eager_iters=args.eager_iters, graph_replays=1, host_samples=1)
    rows = []
    for shape in ROWS:
        rows.append(measure(*shape, timer, generator, args.rounds))
        print(rows[-1], flush=True)
    payload = dict(environment=harness.environment(device), rows=rows)
    harness.write_json(harness.resolve_out_dir(args.out) / "eager_device_time_bound.json", payload)


if __name__ == "__main__":
    main()
