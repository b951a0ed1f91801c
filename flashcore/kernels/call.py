"""``KernelCall``: the arguments of one validated ``attention_with_kv_cache`` call, as every kernel receives them.

Each attention kernel module exposes ``supports(call) -> bool`` and ``run(call) -> out`` over this one tuple, so the
signature is written once (here) and ``flashcore.kernels.ATTENTION_KERNELS`` can dispatch over them in order. The
meaning of every field is the contract's (:func:`flashcore.attention_with_kv_cache`); by the time a kernel sees a
call, ``flashcore.ops`` has validated it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KernelCall(NamedTuple):
    query: torch.Tensor  # [B, H_q, S_q, D]
    key: torch.Tensor  # [B, H_kv, S_q, D]: the new tokens' keys
    value: torch.Tensor  # [B, H_kv, S_q, D]
    k_cache: torch.Tensor  # [B, H_kv, S_max, D]
    v_cache: torch.Tensor  # [B, H_kv, S_max, D]
    seq_lens: torch.Tensor  # [B] int32, advanced in place by the kernel
    query_lens: torch.Tensor | None  # [B] int32 valid new tokens per row; None: S_q for every row
    is_causal: bool
    scale: float  # the softmax scale, resolved (never None)
    sliding_window: int  # 0: no window
