"""The decoder layer's pointwise kernels around attention: RMSNorm (alone, or after the residual add), SiLU-and-mul,
rotary embedding.

Each kernel rounds to the input dtype where transformers' eager code does (``LlamaRMSNorm``, ``act_fn(gate) * up``,
``apply_rotary_pos_emb``), so in bf16 it differs from HF's eager result only in the norm's summation order and in
the ``exp``/``rsqrt`` implementations; the RoPE's products and sums are HF's to the bit (:func:`rotate_halves`). The
point is that eager calls, CUDA-graph replays and ``torch.compile`` all run these same kernels
(``flashcore/layer_ops.py``), so they give the same bits.

All of them launch with programmatic dependent launch where flashcore's attention kernel does: a launch may start
while the previous kernel drains, and ``gdc_wait`` holds every memory access until that kernel's writes are visible.
Right after its wait each releases its dependents (``gdc_launch_dependents``), so that the next kernel, a GEMV of
``flashcore/kernels/triton/gemv.py`` that loads its weight before its own wait, starts while this one runs. That is
safe because every kernel launched this way waits before it reads what its predecessor writes, and writes nothing
before its wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashcore.kernels.launch import CachedLauncher, uses_programmatic_launch

MAX_NORM_WIDTH = 65536  # one program holds a whole row of the norm in registers


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, hidden], unit stride along hidden
    residual_ptr,  # [rows, hidden], unit stride along hidden; read only when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    sum_ptr,  # [rows, hidden], contiguous; written only when HAS_RESIDUAL
    out_ptr,  # [rows, hidden], contiguous
    stride_x_row,
    stride_residual_row,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per row: ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, in fp32 with HF's one rounding
    before the weight. With ``HAS_RESIDUAL``, ``x`` is first replaced by ``(residual + x).to(dtype)``, written to
    ``sum``: HF's ``residual + hidden_states`` followed by the next ``LlamaRMSNorm``."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)  # no kernel writes it: before the wait
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual_row + offs, mask=mask, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * hidden + offs, x, mask=mask)
    squares = x.to(tl.float32) * x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / hidden + eps)
    tl.store(out_ptr + row * hidden + offs, rms_normalize(x, inv_rms, weight), mask=mask)


@triton.jit
def rms_normalize(x, inv_rms, weight):
    """``weight * (x * inv_rms).to(dtype)`` rounded to the dtype, ``LlamaRMSNorm``'s two roundings, for a block of
    the row ``x`` and of the norm's weight (same dtype); the GEMV that folds the norm in (``gemv.py``) uses it too."""
    normalized = (x.to(tl.float32) * inv_rms).to(x.dtype)
    return (weight.to(tl.float32) * normalized.to(tl.float32)).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr,  # [rows, width], unit stride along width
    up_ptr,  # [rows, width], unit stride along width
    out_ptr,  # [rows, width], contiguous
    stride_gate_row,
    stride_up_row,
    width,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``silu(gate).to(dtype) * up``: HF's ``act_fn(gate) * up`` with its rounding of the activation."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    gate = tl.load(gate_ptr + row * stride_gate_row + offs, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up_row + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * width + offs, silu_and_mul(gate, up), mask=mask)


@triton.jit
def silu_and_mul(gate, up):
    """``silu(gate).to(dtype) * up`` rounded to the dtype, for two blocks of the same dtype; the GEMV of the down
    projection (``flashcore/kernels/triton/gemv.py``) computes its input with it too, to the same bits."""
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (activated * up.to(tl.float32)).to(dtype)


@triton.jit
def _ptx_f32(OP: tl.constexpr, a, b):
    """``a OP b`` in fp32 as one PTX instruction rounded to nearest (``mul.rn.f32``, ``add.rn.f32``)."""
    return tl.inline_asm_elementwise(
        f"{OP}.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def rotate_halves(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi, EXACT: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` for the two halves of heads (``lo``, ``hi``: in the dtype; cos and sin in
    fp32), each product and the sum rounded to the dtype as in HF's eager code; returns ``(out_lo, out_hi)`` in the
    dtype. The GEMV that folds the RoPE in (``gemv.py``) uses it too, to the same bits.

    ``EXACT`` (on the GPU): the products and sums as PTX ``mul.rn.f32``/``add.rn.f32``, which the compiler never
    contracts. Written as ``*`` and ``+``, they became ``fma.rn.bf16x2`` on the H100 (each product and the sum after
    it narrowed to bf16 and fused), and an output could differ by an ulp from HF's (NOTES.md, entry 56); libdevice's
    ``mul_rn`` compiles to ``mul.rn.ftz``, which flushes subnormals. The interpreter, which runs no PTX, computes
    numpy's separate ``*`` and ``+``."""
    dtype = lo.dtype
    lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    if EXACT:
        lo_cos, hi_sin = _ptx_f32("mul", lo, cos_lo).to(dtype), _ptx_f32("mul", -hi, sin_lo).to(dtype)
        hi_cos, lo_sin = _ptx_f32("mul", hi, cos_hi).to(dtype), _ptx_f32("mul", lo, sin_hi).to(dtype)
        out_lo = _ptx_f32("add", lo_cos.to(tl.float32), hi_sin.to(tl.float32))
        out_hi = _ptx_f32("add", hi_cos.to(tl.float32), lo_sin.to(tl.float32))
    else:
        out_lo = (lo * cos_lo).to(dtype).to(tl.float32) + (-hi * sin_lo).to(dtype).to(tl.float32)
        out_hi = (hi * cos_hi).to(dtype).to(tl.float32) + (lo * sin_hi).to(dtype).to(tl.float32)
    return out_lo.to(dtype), out_hi.to(dtype)


@triton.jit
def _rotary_embedding_kernel(
    q_ptr,  # [B, H_q, S, D], unit stride along D
    k_ptr,  # [B, H_kv, S, D], unit stride along D
    cos_ptr,  # [B or 1, S, D], unit stride along D
    sin_ptr,  # like cos
    q_out_ptr,  # [B, H_q, S, D], contiguous
    k_out_ptr,  # [B, H_kv, S, D], contiguous
    stride_q_b,
    stride_q_h,
    stride_q_s,
    stride_k_b,
    stride_k_h,
    stride_k_s,
    stride_cos_b,
    stride_cos_s,
    num_tokens,  # S
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,  # D / 2
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program
    EXACT: tl.constexpr,  # see rotate_halves
    USE_PDL: tl.constexpr,
):
    """One program per (batch, token) and ``BLOCK_H`` heads; heads ``[0, H_q)`` are query heads, the next ``H_kv``
    key heads. One program per head was 327,680 one-warp programs for a 16 x 512-token prefill of 40 heads, which
    took 395 µs a layer, bound by the programs' launches (NOTES.md, entry 66)."""
    batch = (tl.program_id(0) // num_tokens).to(tl.int64)
    token = (tl.program_id(0) % num_tokens).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, HALF_PAD)
    mask_half = offs < HALF
    mask = (heads < num_q_heads + num_kv_heads)[:, None] & mask_half[None, :]
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    angles = batch * stride_cos_b + token * stride_cos_s + offs
    cos_lo = tl.load(cos_ptr + angles, mask=mask_half, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(cos_ptr + HALF + angles, mask=mask_half, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(sin_ptr + angles, mask=mask_half, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(sin_ptr + HALF + angles, mask=mask_half, other=0.0).to(tl.float32)[None, :]
    is_query = heads < num_q_heads
    q_heads = tl.minimum(heads, num_q_heads - 1)  # clamped so the pointers of the other kind stay in bounds
    kv_heads = tl.maximum(heads - num_q_heads, 0)
    x_rows = tl.where(
        is_query,
        q_ptr + batch * stride_q_b + q_heads * stride_q_h + token * stride_q_s,
        k_ptr + batch * stride_k_b + kv_heads * stride_k_h + token * stride_k_s,
    )
    out_rows = tl.where(
        is_query,
        q_out_ptr + ((batch * num_q_heads + q_heads) * num_tokens + token) * (2 * HALF),
        k_out_ptr + ((batch * num_kv_heads + kv_heads) * num_tokens + token) * (2 * HALF),
    )
    lo = tl.load(x_rows[:, None] + offs[None, :], mask=mask, other=0.0)
    hi = tl.load(x_rows[:, None] + HALF + offs[None, :], mask=mask, other=0.0)
    out_lo, out_hi = rotate_halves(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi, EXACT)
    tl.store(out_rows[:, None] + offs[None, :], out_lo, mask=mask)
    tl.store(out_rows[:, None] + HALF + offs[None, :], out_hi, mask=mask)


_launch_rms_norm = CachedLauncher(_rms_norm_kernel)
ROTARY_HEADS_PER_PROGRAM = 16  # at most; the probes set 1 for the one-head programs of before entry 66
_launch_silu_and_mul = CachedLauncher(_silu_and_mul_kernel)
_launch_rotary_embedding = CachedLauncher(_rotary_embedding_kernel)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``[rows, hidden]`` with unit stride along hidden; returns a contiguous ``[rows, hidden]``."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, None, weight, eps, None, out)
    return out


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, sum_out: torch.Tensor, out: torch.Tensor
) -> None:
    """``x``, ``residual``: ``[rows, hidden]`` with unit stride along hidden; writes ``residual + x`` into ``sum_out``
    and its RMSNorm into ``out`` (both contiguous ``[rows, hidden]``)."""
    _launch_norm(x, residual, weight, eps, sum_out, out)


def _launch_norm(x, residual, weight, eps, sum_out, out) -> None:
    rows, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    use_pdl = uses_programmatic_launch(x.device)
    _launch_rms_norm(
        (rows, 1, 1),
        (
            x, residual if has_residual else x, weight, sum_out if has_residual else out, out,
            x.stride(0), residual.stride(0) if has_residual else 0, hidden, float(eps),
        ),
        dict(BLOCK=block, HAS_RESIDUAL=has_residual, USE_PDL=use_pdl),
        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,
        num_stages=1,
        launch_pdl=use_pdl,
    )  # fmt: skip


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gate``, ``up``: ``[rows, width]`` with unit stride along width; returns ``out``, a contiguous ``[rows,
    width]`` (a new one if None)."""
    rows, width = gate.shape
    if out is None:
        out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(width))
    use_pdl = uses_programmatic_launch(gate.device)
    _launch_silu_and_mul(
        (rows, triton.cdiv(width, block), 1),
        (gate, up, out, gate.stride(0), up.stride(0), width),
        dict(BLOCK=block, USE_PDL=use_pdl),
        num_warps=4,
        num_stages=1,
        launch_pdl=use_pdl,
    )
    return out


def rotary_embedding_triton(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query`` ``[B, H_q, S, D]``, ``key`` ``[B, H_kv, S, D]``, ``cos``/``sin`` ``[B or 1, S, D]`` (same strides),
    each with unit stride along D. Returns the rotated query and key as contiguous ``[B, H, S, D]`` tensors, the
    layout the attention kernels read (the Gluon prefill kernel's TMA descriptors take no other; NOTES.md, entry 67).
    At one token that is the memory of HF's ``[B, S, H, D]`` storage."""
    batch, num_q_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    query_out = torch.empty((batch, num_q_heads, num_tokens, head_dim), dtype=query.dtype, device=query.device)
    key_out = torch.empty((batch, num_kv_heads, num_tokens, head_dim), dtype=key.dtype, device=key.device)
    half, half_pad = head_dim // 2, triton.next_power_of_2(head_dim // 2)
    block_h = min(ROTARY_HEADS_PER_PROGRAM, triton.next_power_of_2(num_q_heads + num_kv_heads))
    use_pdl = uses_programmatic_launch(query.device)
    _launch_rotary_embedding(
        (batch * num_tokens, triton.cdiv(num_q_heads + num_kv_heads, block_h), 1),
        (
            query, key, cos, sin, query_out, key_out,
            query.stride(0), query.stride(1), query.stride(2),
            key.stride(0), key.stride(1), key.stride(2),
            cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
            num_tokens, num_q_heads, num_kv_heads,
        ),
        dict(HALF=half, HALF_PAD=half_pad, BLOCK_H=block_h, EXACT=query.is_cuda, USE_PDL=use_pdl),
        num_warps=max(1, min(4, block_h * half_pad // 256)),
        num_stages=1,
        launch_pdl=use_pdl,
    )  # fmt: skip
    return query_out, key_out
