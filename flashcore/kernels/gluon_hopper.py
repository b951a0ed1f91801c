"""What the Gluon kernels share: their imports across triton versions, where they can run, their TMA descriptors.

Gluon (``triton.experimental.gluon``) ships with triton but is experimental: names move between versions (3.6 on
the H100 machine, 3.9 on CI), and it has no interpreter. Without it, :func:`runs_on` is False and the kernels that
import from here are never defined.
"""

from __future__ import annotations

import functools
import os

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
    "HAS_GLUON", "TensorDescriptor", "fence_async_shared", "gl", "gluon", "mbarrier", "mma_v2", "partition_barrier",
    "runs_on", "tile_descriptor", "tma_load", "warpgroup_mma", "warpgroup_mma_wait",
]  # fmt: skip


def runs_on(device: torch.device) -> bool:
    """Whether the Gluon kernels can run on ``device``: an sm_90 GPU, not the interpreter."""
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
