"""Issue 29: why a B=16 ``DecodeSession``'s replayed step is about 70 µs slower from the fourth one of a process on.

``probes/session_add_norm_b16.py`` (entry 63) timed fresh ``DecodeSession`` objects one after another on one model:
the first three of the process stepped in 1433-1453 µs, every later one in 1502-1528, whatever the variant, with
the SM clock at 1980 MHz throughout. This probe builds ``--sessions`` ``DecodeSession`` objects in turn
(``fuse_projections``, ``layer_kernels``, no compile; ``bench_generate``'s model, bf16, 16 random 512-token prompts,
``max_cache_len`` 2048), times each as ``harness.session_steps`` does, and records where its buffers landed: each
layer's K and V buffer addresses (their offsets in 2 MiB pages) and the caching allocator's reserved and allocated
bytes. Options, one change each:

- ``--empty-cache``: the allocator returns its free blocks to the driver after each one;
- ``--keep``: every one stays alive (its cache, scratch and CUDA graphs held) while the next ones run;
- ``--alternate``: the even ones run the add after attention and the MLP's norm as two launches (as
  ``session_add_norm_b16.py``'s ``separate``);
- ``--no-gc``: a finished one is left to Python's collector, as ``harness.session_steps`` leaves it;
- ``--clone``: each warm-up step's token is cloned, as ``harness.session_steps`` clones it;
- ``--copy-into``: each warm-up step's token is copied into a buffer allocated before the session (the clone's
  copy kernels without its allocations);
- ``--copy-sessions N``: ``--clone`` and ``--copy-into`` apply to the first N sessions only (whether the slow state
  stays once the copies stop);
- ``--own-stream``: each one runs (warm-up, capture, timing) on a stream of its own instead of the default stream;
- ``--stream-priority P``: with ``--own-stream``, the streams get priority P (-1 is high on the H100, 0 the default);
- ``--fresh-capture-stream``: each one captures on a new stream (``torch.cuda.graph`` otherwise captures every graph
  of the process on one stream it creates once);
- ``--dump-graphs DIR``: each session's captured graphs written there as DOT (CUDA's verbose dump, gzipped), and
  their nodes and edges counted by kind in the row;
- ``--upload``: with ``--dump-graphs``, each graph is uploaded (``cudaGraphUpload``, to the default stream, then a
  sync) once instantiated, before its first replay;
- ``--profile``: each one's replayed steps are also profiled (``decode_step_kernels.profile_session``), advance by
  kernel category.

    python benchmarks/probes/session_placement_b16.py --out session_placement_b16.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import gzip
import json
import os
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_step_kernels  # noqa: E402
import harness  # noqa: E402

from flashcore.integrations import layer_kernels  # noqa: E402
from flashcore.integrations.decode_session import DecodeSession  # noqa: E402

PAGE = 2 * 2**20


def placement(session: DecodeSession) -> dict:
    keys = [session.cache.get_kv_cache(i) for i in range(len(session.cache.layers))]
    return {
        "k_ptrs": [hex(k.data_ptr()) for k, _, _ in keys],
        "v_ptrs": [hex(v.data_ptr()) for _, v, _ in keys],
        "k_page_offsets": [k.data_ptr() % PAGE for k, _, _ in keys],
        "v_page_offsets": [v.data_ptr() % PAGE for _, v, _ in keys],
        "reserved_mb": torch.cuda.memory_reserved() / 2**20,
        "allocated_mb": torch.cuda.memory_allocated() / 2**20,
        "segments": segments(),
    }


DUMPED: list[Path] = []  # the graphs the current session captured, as dumped


def dumping_graph_class(base: type, folder: Path, upload: bool) -> type:
    """A ``torch.cuda.CUDAGraph`` that dumps itself as DOT once captured (into ``folder``, named by capture), then
    instantiates itself, and with ``upload`` uploads itself to the default stream."""

    class DumpingGraph(base):
        def __new__(cls, *args, **kwargs):
            return super().__new__(cls, keep_graph=True)  # its graph kept to dump, then instantiated

        def __init__(self, *args, **kwargs):
            super().__init__(keep_graph=True)

        def capture_end(self):
            super().capture_end()
            path = folder / f"graph_{len(list(folder.iterdir())):03d}.dot"
            cudart().cudaGraphDebugDotPrint(
                ctypes.c_void_p(self.raw_cuda_graph()), str(path).encode(), ctypes.c_uint(1)
            )  # cudaGraphDebugDotFlagsVerbose
            if not path.exists():
                raise RuntimeError(f"cudaGraphDebugDotPrint wrote no {path}")
            DUMPED.append(path)
            self.instantiate()
            if upload:
                stream = ctypes.c_void_p(torch.cuda.default_stream().cuda_stream)  # where it replays
                error = cudart().cudaGraphUpload(ctypes.c_void_p(self.raw_cuda_graph_exec()), stream)
                if error:
                    raise RuntimeError(f"cudaGraphUpload returned {error}")
                torch.cuda.synchronize()

    return DumpingGraph


def cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch loaded (found in this process's mapped files)."""
    paths = {line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("libcudart is not loaded")
    return ctypes.CDLL(sorted(paths)[0])


def graph_summary(path: Path, session: int) -> dict:
    """A dumped graph's nodes by kind and edges by kind; the DOT file gzipped, named by the session."""
    text = path.read_text()
    nodes = re.findall(r"\b(KERNEL|MEMCPY|MEMSET|HOST|GRAPH|EMPTY|WAIT_EVENT|EVENT_RECORD|MEM_ALLOC|MEM_FREE)\b", text)
    edges = [line for line in text.splitlines() if "->" in line]
    edge_kinds: dict[str, int] = {}
    for line in edges:
        kind = re.sub(r"\d+", "#", line.split("->", 1)[1].split("[", 1)[-1]) if "[" in line else "plain"
        edge_kinds[kind.strip()[:80]] = edge_kinds.get(kind.strip()[:80], 0) + 1
    gz = path.with_name(f"session{session}_{path.name}.gz")
    gz.write_bytes(gzip.compress(text.encode()))
    path.unlink()
    return {"file": gz.name, "nodes": {kind: nodes.count(kind) for kind in set(nodes)}, "edges": len(edges),
            "edge_kinds": edge_kinds}  # fmt: skip


def segments() -> dict:
    """The caching allocator's segments: how many, of which pool and type, and their addresses in 2 MiB pages."""
    rows = torch.cuda.memory_snapshot()
    return {
        "count": len(rows),
        "small": sum(row["segment_type"] == "small" for row in rows),
        "private_pools": len({tuple(row["segment_pool_id"]) for row in rows} - {(0, 0)}),
        "pages": sorted(
            (
                hex(row["address"] // PAGE),
                row["total_size"] // 2**10,
                row["segment_type"][0],
                list(row["segment_pool_id"]),
            )
            for row in rows
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--empty-cache", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep every session alive (as a reference cycle would)")
    parser.add_argument("--alternate", action="store_true", help="odd sessions run the add and the norm apart")
    parser.add_argument("--no-gc", action="store_true", help="no gc.collect() after a session")
    parser.add_argument("--clone", action="store_true", help="clone each warm-up token, as harness.session_steps does")
    parser.add_argument("--copy-into", action="store_true", help="copy each warm-up token into a preallocated buffer")
    parser.add_argument("--copy-sessions", type=int, default=None, help="copies in the first N sessions only")
    parser.add_argument("--own-stream", action="store_true", help="each session on a stream of its own")
    parser.add_argument("--stream-priority", type=int, default=0, help="with --own-stream: the streams' priority")
    parser.add_argument("--fresh-capture-stream", action="store_true", help="each session captures on a new stream")
    parser.add_argument("--dump-graphs", help="a folder for each session's graphs, as gzipped DOT")
    parser.add_argument("--upload", action="store_true", help="with --dump-graphs: upload each graph before replays")
    parser.add_argument("--profile", action="store_true", help="also each session's kernels by category")
    args = parser.parse_args()
    device = torch.device("cuda")
    model, input_ids = harness.bench_model_and_prompts(16, device)
    options = dict(fuse_projections=True, layer_kernels=True)
    max_cache_len, replays = harness.SESSION_SHAPE["max_cache_len"], harness.SESSION_SHAPE["replays"]
    rows, kept = [], []
    runs_kernel_norm = layer_kernels.runs_kernel_norm
    if args.dump_graphs:
        Path(args.dump_graphs).mkdir(parents=True, exist_ok=True)
        torch.cuda.CUDAGraph = dumping_graph_class(torch.cuda.CUDAGraph, Path(args.dump_graphs), args.upload)
    with torch.inference_mode():
        for index in range(args.sessions):
            DUMPED.clear()
            # harness.session_steps, keeping the session to read where its buffers landed
            if args.alternate and index % 2 == 0:
                layer_kernels.runs_kernel_norm = lambda norm: False  # the add and the norm as two launches
            if args.fresh_capture_stream:
                torch.cuda.graph.default_capture_stream = None  # the next capture creates a new one
            stream = (
                torch.cuda.Stream(priority=args.stream_priority) if args.own_stream else torch.cuda.current_stream()
            )
            stream.wait_stream(torch.cuda.current_stream())
            try:
                stream_context = torch.cuda.stream(stream)
                stream_context.__enter__()
                saved = torch.empty(32, 16, dtype=torch.long, device=device) if args.copy_into else None
                session = DecodeSession(model, max_cache_len=max_cache_len, batch_size=16, **options)
                copies = args.copy_sessions is None or index < args.copy_sessions
                if args.clone and copies:
                    tokens = [session.prefill(input_ids).clone()]
                    tokens += [session.decode_step().clone() for _ in range(31)]
                elif saved is not None and copies:  # --copy-into: the copies, into rows allocated before
                    saved[0].copy_(session.prefill(input_ids))
                    for row in saved[1:]:
                        row.copy_(session.decode_step())
                else:
                    session.prefill(input_ids)
                    for _ in range(31):
                        session.decode_step()
                timings = [1e3 * ms for ms in harness.ms_per_call_repeated(session.decode_step, replays, 5)]
                torch.cuda.synchronize()
            finally:
                stream_context.__exit__(None, None, None)
                layer_kernels.runs_kernel_norm = runs_kernel_norm
            rows.append({"session": index, "us_per_step": statistics.median(timings), **placement(session)})
            if args.dump_graphs:
                rows[-1]["graphs"] = [graph_summary(path, index) for path in DUMPED]
            if args.profile:
                profile = decode_step_kernels.profile_session(session, 10)
                rows[-1]["span_us_median"] = profile["span_us_median"]
                rows[-1]["advance_us_by_category"] = profile["advance_us_by_category"]
                rows[-1]["us_by_category"] = profile["us_by_category"]
                rows[-1]["kernel_us_sum"] = profile["kernel_us_sum"]
                rows[-1]["gap_us_sum"] = profile["gap_us_sum"]
                rows[-1]["kernels"] = [  # the median step's kernels: name, duration and gap before it, µs
                    (row["name"][:60], round(row["us"], 2), round(row["gap_us"], 2)) for row in profile["median_step"]
                ]
                print({key: round(value, 1) for key, value in profile["advance_us_by_category"].items()}, flush=True)
            if args.keep:
                kept.append(session)
            del session
            if not args.no_gc:
                gc.collect()
            if args.empty_cache:
                torch.cuda.empty_cache()
            print(index, round(rows[-1]["us_per_step"], 1), rows[-1]["k_ptrs"][0], rows[-1]["reserved_mb"], flush=True)
    settings = {**vars(args), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    result = {"environment": harness.environment(device), "settings": settings, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
