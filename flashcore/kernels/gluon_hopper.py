"""What the Gluon kernels share: their imports across triton versions, where they can run, their TMA descriptors,
and the online-softmax step.

Gluon (``triton.experimental.gluon``) ships with triton but is experimental: names move between versions (3.6 on
the H100 machine, 3.9 on CI), and it has no interpreter. Without it, :func:`runs_on` is False and the kernels that
import from here are never defined.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
    # A barrier over the calling partition's warps, and the TMA global -> shared copy (same arguments in both).
    partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
except ImportError:
    HAS_GLUON = False

__all__ = [
    "HAS_GLUON", "TensorDescriptor", "fence_async_shared", "gl", "gluon", "mbarrier", "mma_v2", "online_softmax_step",
    "partition_barrier", "runs_on", "tile_descriptor", "CacheTileGrid", "cache_tile_grid", "cached_tile_descriptor",
    "tma_load", "warpgroup_mma", "warpgroup_mma_wait",
]  # fmt: skip

if HAS_GLUON:

    @gluon.jit
    def online_softmax_step(scores, m_i, l_i, qk_scale):
        """One key tile of the online softmax over fp32 ``scores`` (hidden keys at -inf), ``qk_scale`` being the
        softmax scale times log2(e). Returns ``p`` (this tile's unnormalised weights), ``alpha`` (the factor for
        what was accumulated before), and the row max and row sum after the tile."""
        m_new = gl.maximum(m_i, gl.max(scores, 1) * qk_scale)
        # A row with nothing visible yet keeps m = -inf; shifting by 0 keeps exp2 finite (0, not NaN).
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(scores * qk_scale - m_shift[:, None])
        alpha = gl.exp2(m_i - m_shift)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@functools.cache
def runs_on(device: torch.device) -> bool:
    """Whether the Gluon kernels can run on ``device``: an sm_90 GPU, not the interpreter.

    Cached: ops asks on every call, and the capability query alone cost 2.5-5 us of host time on the H100
    machine (benchmarks/NOTES.md, entry 31).
    """
    if not HAS_GLUON or device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def _tile_layout(dtype: torch.dtype, block_rows: int, head_dim: int):
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], gl_dtype)


def tile_descriptor(tensor: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """A TMA descriptor over a contiguous ``[..., D]`` tensor viewed as ``[rows, D]``, in ``[block_rows, D]`` boxes."""
    head_dim = tensor.shape[-1]
    layout = _tile_layout(tensor.dtype, block_rows, head_dim)
    return TensorDescriptor.from_tensor(tensor.view(-1, head_dim), [block_rows, head_dim], layout)


class _DeviceAddress:
    """What a host TMA descriptor reads of its base tensor (the address and the dtype), without holding it."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


class CacheTileGrid(NamedTuple):
    """A ``[B, H_kv, S_max, D]`` cache seen as the 2D ``[rows, cols]`` tensor a TMA descriptor walks: token
    ``(b, h, s)`` starts at row ``b * rows_per_batch + h * rows_per_head + s``, column ``h * cols_per_head``, so
    element ``d`` of it sits at ``row * cols + column + d`` in the buffer."""

    rows: int
    cols: int
    rows_per_batch: int
    rows_per_head: int
    cols_per_head: int


def cache_tile_grid(cache: torch.Tensor) -> CacheTileGrid | None:
    """The 2D view of a cache in one of the two layouts the Gluon kernels read, else None.

    ``[B, H_kv, S_max, D]`` contiguous (each head's tokens together), or a ``[B, S_max, H_kv, D]`` buffer
    transposed to that shape (each token's heads together), which is how :func:`flashcore.allocate_kv_cache`
    allocates it. Cached per shape and strides: ops asks on every call (host time).
    """
    return _cache_tile_grid(cache.shape, cache.stride(), cache.is_contiguous())


@functools.cache
def _cache_tile_grid(shape: torch.Size, strides: tuple[int, ...], is_contiguous: bool) -> CacheTileGrid | None:
    batch, heads, capacity, head_dim = shape
    if is_contiguous:
        return CacheTileGrid(batch * heads * capacity, head_dim, heads * capacity, capacity, 0)
    if strides == (capacity * heads * head_dim, head_dim, heads * head_dim, 1):
        return CacheTileGrid(batch * capacity, heads * head_dim, capacity, 0, head_dim)
    return None


MAX_CACHED_DESCRIPTORS = 1024  # two per layer of each live cache; a new allocation adds one
_descriptors: dict[tuple, tuple[TensorDescriptor, CacheTileGrid]] = {}


def cached_tile_descriptor(cache: torch.Tensor, block_rows: int) -> tuple[TensorDescriptor, CacheTileGrid]:
    """A TMA descriptor over a cache (a tensor that lives across calls, in a layout :func:`cache_tile_grid`
    takes) seen as its grid, in ``[block_rows, D]`` boxes, and that grid; built once per address and layout.

    Building a descriptor (a view, and the dataclass's checks) is most of the host time an eager decode call
    would add to its launch (benchmarks/NOTES.md, entry 30). A descriptor is a function of the address, shape,
    strides, dtype and box alone, so that is the key. It holds the address, not the tensor: a freed cache's memory
    is not kept alive, and a new tensor at the same address and layout gets the same, still correct, descriptor.
    """
    key = (cache.data_ptr(), cache.shape, cache.stride(), cache.dtype, block_rows)
    entry = _descriptors.get(key)
    if entry is None:
        grid = cache_tile_grid(cache)
        head_dim = cache.shape[-1]
        layout = _tile_layout(cache.dtype, block_rows, head_dim)
        base = _DeviceAddress(cache.data_ptr(), cache.dtype)
        descriptor = TensorDescriptor(base, [grid.rows, grid.cols], [grid.cols, 1], [block_rows, head_dim], layout)
        if len(_descriptors) >= MAX_CACHED_DESCRIPTORS:
            _descriptors.clear()
        entry = _descriptors[key] = (descriptor, grid)
    return entry
