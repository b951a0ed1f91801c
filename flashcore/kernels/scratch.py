"""Persistent per-device scratch: the split-KV partials and the ticket counters the decode kernels share."""

from __future__ import annotations

import threading

import torch

_scratch_by_key: dict[tuple[str, torch.device], torch.Tensor] = {}
_retired_scratch: list[torch.Tensor] = []


def scratch_buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A persistent per-device buffer of at least ``numel`` elements, reused across calls.

    Reuse saves an allocation per call; launches on one stream run in order, so calls never share it at
    the same time (two streams running flashcore at once on one device are not supported). Buffers are
    never freed, because a captured CUDA graph may still hold their address. A buffer first needed while a
    graph is being captured is allocated for that graph only (its zeroing becomes a node of the graph).
    The ticket buffers (``"row_tickets"``, ``"tile_tickets"``) are allocated zeroed, and every launch leaves
    them zeroed.
    """
    buffer = _scratch_by_key.get((name, device))
    if buffer is not None and buffer.numel() >= numel:
        return buffer
    numel = max(numel, 1024)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(numel, dtype=dtype, device=device)
    buffer = _allocate_outside_graph_pools(numel, dtype, device)
    old = _scratch_by_key.get((name, device))
    if old is not None:
        _retired_scratch.append(old)
    _scratch_by_key[(name, device)] = buffer
    return buffer


def _allocate_outside_graph_pools(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros from the caching allocator's default pool, also inside a warm-up run of torch.compile's CUDA-graph trees.

    A warm-up run sends every allocation of its thread to the trees' private pool, and a persistent buffer kept from
    there makes the next recording fail ("tensors in the cudagraph pool not tracked as outputs"): HF's compiled
    ``generate`` did at B=1 when its first flashcore decode step, the first to need the split-KV scratch, was a
    compiled one (benchmarks/NOTES.md, entry 48). Another thread's allocation stays in the default pool; the zeroing
    runs on the caller's stream, before the caller's next kernel.
    """
    if device.type != "cuda":
        return torch.zeros(numel, dtype=dtype, device=device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    allocated = []
    thread = threading.Thread(target=lambda: allocated.append(torch.empty(numel, dtype=dtype, device=device)))
    thread.start()
    thread.join()
    return allocated[0].zero_()


_partial_views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_partials(rows: int, num_splits: int, head_dim: int, device: torch.device):
    """Views ``[rows, splits, D]`` (outputs) and ``[rows, splits]`` (LSEs) into the persistent scratch buffer.

    The views are cached per shape: slicing and viewing cost host time on every call, and host time is most of
    what an eager decode call costs.
    """
    buffer = scratch_buffer("partials", rows * num_splits * (head_dim + 1), torch.float32, device)
    key = (id(buffer), rows, num_splits, head_dim)
    views = _partial_views.get(key)
    if views is None:
        out_numel = rows * num_splits * head_dim
        views = (
            buffer[:out_numel].view(rows, num_splits, head_dim),
            buffer[out_numel : out_numel + rows * num_splits].view(rows, num_splits),
        )
        # A buffer allocated during graph capture belongs to that graph alone (see scratch_buffer): not cached.
        if _scratch_by_key.get(("partials", device)) is buffer:
            _partial_views[key] = views
    return views
