"""What the Gluon sm_90 kernels share: their imports across triton versions, where they can run, their TMA
descriptors, the online-softmax step, and the seq_lens ticket and split merge (Gluon copies of the Triton protocol).

Gluon (``triton.experimental.gluon``) ships with triton but is experimental: names move between versions (3.6 on
the H100 machine, 3.9 on CI), and it has no interpreter. Without it, :func:`runs_on` is False and the kernels that
import from here are never defined.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flashcore.backends import per_device, triton_interpreter_enabled

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
    "HAS_GLUON", "TensorDescriptor", "advance_seq_lens_after_last_program", "fence_async_shared", "gl", "gluon",
    "launch_dependents", "mbarrier", "merge_kv_splits", "mma_v2", "online_softmax_step", "partition_barrier",
    "runs_on", "tile_descriptor", "CacheTileGrid", "cache_tile_grid", "cached_tile_descriptor", "streams_cache",
    "tma_load", "wait_for_previous_grid", "warpgroup_mma", "warpgroup_mma_wait",
]  # fmt: skip

if HAS_GLUON:

    @gluon.jit
    def wait_for_previous_grid():
        """Programmatic dependent launch: wait until the kernel before has finished and its writes are visible."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def launch_dependents():
        """Programmatic dependent launch: let the next kernel start (it waits in its turn before reading our writes)."""
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )

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

    # The Triton bodies' protocol (kernels/triton/split_merge.py) in Gluon. A Gluon kernel cannot call those
    # @triton.jit helpers: Gluon builds every tensor with an explicit layout, and they build theirs without. So the
    # two Gluon kernels share these copies, which must stay op for op equal to the Triton ones.

    @gluon.jit
    def advance_seq_lens_after_last_program(seq_lens_ptr, row_tickets_ptr, batch, new_seq_len, num_row_programs):
        """``split_merge._advance_seq_lens_after_last_tile``: the last of the row's programs to take its ticket
        writes ``seq_lens[batch]``. acq_rel: every program read seq_lens before taking its ticket."""
        if gl.atomic_add(row_tickets_ptr + batch, 1, sem="acq_rel") == num_row_programs - 1:
            gl.store(seq_lens_ptr + batch, new_seq_len)
            gl.atomic_xchg(row_tickets_ptr + batch, 0)

    @gluon.jit
    def merge_kv_splits(
        partial_out_ptr, partial_lse_ptr, out_ptr, first_row, num_rows, num_splits,
        HEAD_DIM: gl.constexpr, SPLITS_PAD: gl.constexpr, MERGE_ROWS: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):  # fmt: skip
        """``split_merge._merge_kv_splits``, op for op: each output element is summed over the splits in index order
        by the thread that holds it, so this merge (eager calls) and the Triton merge launch (captured calls) give
        the same bits, and a graph-replayed decode step the same tokens as an eager one. Rows
        ``[first_row, first_row + num_rows)``, at most ``MERGE_ROWS``."""
        tile: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NUM_WARPS, 1], [1, 0])
        rows_of_tile: gl.constexpr = gl.SliceLayout(1, tile)
        cols_of_tile: gl.constexpr = gl.SliceLayout(0, tile)
        offs_row = gl.arange(0, MERGE_ROWS, layout=rows_of_tile)
        offs_split = gl.arange(0, SPLITS_PAD, layout=cols_of_tile)
        offs_d = gl.arange(0, HEAD_DIM, layout=cols_of_tile)
        is_row_valid = offs_row < num_rows
        rows = (first_row + offs_row).to(gl.int64)
        mask_split = is_row_valid[:, None] & (offs_split[None, :] < num_splits)
        lse = gl.load(
            partial_lse_ptr + rows[:, None] * num_splits + offs_split[None, :],
            mask=mask_split,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        lse_max = gl.max(lse, 1)
        lse_shift = gl.where(lse_max == float("-inf"), 0.0, lse_max)
        merged = gl.zeros([MERGE_ROWS, HEAD_DIM], gl.float32, tile)
        weight_sum = gl.zeros([MERGE_ROWS], gl.float32, rows_of_tile)
        for split in gl.static_range(SPLITS_PAD):
            is_split = is_row_valid & (split < num_splits)
            partial_row = rows * num_splits + split
            split_lse = gl.load(partial_lse_ptr + partial_row, mask=is_split, other=float("-inf"), cache_modifier=".cg")
            partial = gl.load(
                partial_out_ptr + partial_row[:, None] * HEAD_DIM + offs_d[None, :],
                mask=is_split[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            weight = gl.exp2(split_lse - lse_shift)
            weight_sum += weight
            merged += partial * weight[:, None]
        merged = merged / gl.where(weight_sum > 0.0, weight_sum, 1.0)[:, None]
        out_ptrs = out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
        gl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty), mask=is_row_valid[:, None])


@per_device
def runs_on(device: torch.device) -> bool:
    """Whether the Gluon kernels can run on ``device``: an sm_90 GPU, not the interpreter.

    Cached: ops asks on every call, and the capability query was a large part of the Gluon path's eager host
    time on the H100 machine (benchmarks/NOTES.md, entry 31).
    """
    if not HAS_GLUON or device.type != "cuda" or triton_interpreter_enabled():
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def streams_cache(call, head_dims: tuple[int, ...]) -> bool:
    """What both Gluon kernels need of a call, besides their own shape rules: an sm_90 GPU, fp16/bf16, a head dim
    they were built for, no window, and K/V caches their TMA descriptors can walk (one layout
    :func:`cache_tile_grid` takes, shared by K and V, 16-byte aligned, coordinates within int32)."""
    query, k_cache, v_cache = call.query, call.k_cache, call.v_cache
    return (
        runs_on(query.device)
        and call.sliding_window == 0
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] in head_dims
        and k_cache.stride() == v_cache.stride()
        and cache_tile_grid(k_cache) is not None
        and k_cache.data_ptr() % 16 == 0
        and v_cache.data_ptr() % 16 == 0
        and k_cache.shape[0] * k_cache.shape[1] * k_cache.shape[2] < 2**31  # TMA coordinates are int32
    )


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
