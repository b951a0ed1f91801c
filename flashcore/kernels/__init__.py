"""The attention kernels, by backend, behind one dispatch table.

A validated call (:class:`~flashcore.kernels.call.KernelCall`) runs on the first kernel of its backend's row whose
``supports(call)`` is true. Every module in the table exposes ``NAME``, ``supports(call)`` and ``run(call)``; every
one obeys the contract of :func:`flashcore.attention_with_kv_cache` and is tested against the same fp64 oracle. A
module whose ``TAKES_OUT`` is true also takes ``run(call, out=...)``, a tensor of any strides with a unit stride
along D to write the output into (``flashcore.ops.AttentionPlan.run``).

==========  ======================  =====================================================================
backend     kernel (``NAME``)       takes
==========  ======================  =====================================================================
``triton``  ``gluon_sm90.decode``   sm_90 GPU; ``S_q == 1``; fp16/bf16; D 64 or 128; ``H_q / H_kv <= 16``;
                                    no window; a cache in ``allocate_kv_cache``'s layout or contiguous
``triton``  ``gluon_sm90.prefill``  sm_90 GPU; causal; ``S_q >= 128``; no ``query_lens``; fp16/bf16;
                                    D in ``configs.GLUON_PREFILL.head_dims``; no window; contiguous q/k/v
``triton``  ``triton.attention``    everything else on CUDA, and on the CPU under ``TRITON_INTERPRET=1``:
                                    prefill, decode and mixed rows, windows, split-KV, any strides, fp32
``torch``   ``torch.sdpa``          any device, except where ``seq_lens`` may not be read on the host (CUDA-graph
                                    capture, ``torch.compile`` tracing): in-place append and
                                    ``F.scaled_dot_product_attention``, ``flashcore/kernels/torch/sdpa.py``
``torch``   ``torch.reference``     everything else: plain PyTorch, the readable statement of the contract,
                                    ``flashcore/reference.py``
==========  ======================  =====================================================================

The Gluon kernels exist where a measured gap justified a second body (benchmarks/NOTES.md, entries 26-31); the
Triton kernel takes every call, so the table never runs out. On the torch row, SDPA is the CPU default (issue 26:
the reference was slower than stock transformers) and the reference is the catch-all. Nothing falls back from one
backend to the other.
"""

from __future__ import annotations

from types import ModuleType

from flashcore import reference
from flashcore.kernels.call import KernelCall
from flashcore.kernels.gluon_sm90 import decode as gluon_sm90_decode
from flashcore.kernels.gluon_sm90 import prefill as gluon_sm90_prefill
from flashcore.kernels.torch import sdpa as torch_sdpa
from flashcore.kernels.triton import attention as triton_attention

ATTENTION_KERNELS: dict[str, tuple[ModuleType, ...]] = {
    "triton": (gluon_sm90_decode, gluon_sm90_prefill, triton_attention),
    "torch": (torch_sdpa, reference),
}
"""For each resolved backend, its kernels in the order they are asked (see the module docstring)."""

__all__ = ["ATTENTION_KERNELS", "KernelCall", "select_kernel"]


def select_kernel(call: KernelCall, backend: str) -> ModuleType:
    """The first kernel of ``backend``'s row that supports ``call`` (the last of each row supports every call)."""
    for kernel in ATTENTION_KERNELS[backend]:
        if kernel.supports(call):
            return kernel
    raise NotImplementedError(f"no {backend} kernel supports this call")  # unreachable: each row ends in a catch-all
