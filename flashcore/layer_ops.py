"""The decoder layer's ops around attention, on flashcore's Triton kernels: RMSNorm (alone, or with the residual add
before it), rotary embedding, SiLU-and-mul, the one-row GEMV of a batch-1 decode step's projections (with the
RMSNorm before them, the rotary embedding or the residual add after them, and for the down projection the
SiLU-and-mul folded in), and the few-row GEMM of a decode step of up to 16 rows (the q/k/v projection, with the
RMSNorm before it and the rotary embedding after it folded in; the o projection; the gate/up projection, with the
SiLU-and-mul after it; the down projection, with the SiLU-and-mul before it or after the gate/up's, and the residual
add; and the LM head).

Why flashcore has its own: a model step runs eagerly, replayed from a CUDA graph, or compiled. Eager and replayed
PyTorch ops give the same bits, but inductor fuses HF's RMSNorm, RoPE and SwiGLU code without eager's intermediate
bf16 roundings and with its own summation order, so a compiled bf16 model picks other tokens at the first near-tie
(``benchmarks/NOTES.md``, entry 8). These ops run one Triton kernel each on every path (inductor sees an opaque
``torch.library`` op), so a model that uses them computes the same bits eagerly, replayed and compiled. They round
where HF's eager code rounds (``flashcore/kernels/triton/layer_kernels.py``). The GEMV is there for speed: it starts
loading its weight while the kernel before it still runs (``flashcore/kernels/triton/gemv.py``), and so does the
few-row GEMM, which takes four launches per layer into it (``flashcore/kernels/triton/rows_gemm.py``; on an sm_90
GPU in fp16/bf16 its calls without a folded norm or RoPE run on a Gluon kernel whose weight tiles come through a ring
of TMA copies, ``flashcore/kernels/gluon_sm90/rows_gemm.py``; there :func:`rows_mlp` runs a SwiGLU MLP's two
projections as one launch, ``rows_mlp.py``).
``apply_flashcore_to_llama(model, layer_kernels=True)`` puts them in a patched model.

Like :func:`flashcore.attention_with_kv_cache` they run on CUDA tensors, or on CPU tensors under
``TRITON_INTERPRET=1``; anything else raises, nothing falls back to PyTorch. Validation reads only shapes, dtypes
and strides, so it is safe under graph capture.
"""

from __future__ import annotations

import torch

from flashcore.backends import SUPPORTED_DTYPES, on_device_of, triton_interpreter_enabled
from flashcore.kernels.gluon_sm90 import rows_gemm as tma_rows_gemm_kernels
from flashcore.kernels.gluon_sm90 import rows_mlp as tma_rows_mlp_kernels
from flashcore.kernels.triton import gemv as gemv_kernels
from flashcore.kernels.triton import layer_kernels
from flashcore.kernels.triton import rows_gemm as rows_gemm_kernels

__all__ = [
    "add_rms_norm", "apply_rotary_embedding", "gemv", "gemv_can_rotate", "rms_norm", "rows_gemm",
    "rows_gemm_can_rotate", "rows_gemm_streams", "rows_mlp", "rows_mlp_fuses", "silu_and_mul", "silu_and_mul_gemv",
    "ROWS_GEMM_MAX_ROWS",
]  # fmt: skip

ROWS_GEMM_MAX_ROWS = rows_gemm_kernels.MAX_ROWS


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)``, the statistics in fp32: HF's ``LlamaRMSNorm``.

    Args:
        hidden_states: ``[..., hidden]``, unit stride along ``hidden``; float16, bfloat16 or float32.
        weight: ``[hidden]``, same dtype and device.
        eps: added to the mean square, >= 0.

    Returns:
        A new contiguous tensor of ``hidden_states``' shape and dtype.
    """
    _check_norm(hidden_states, "hidden_states", weight, eps)
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
    if torch.compiler.is_compiling():
        out = torch.ops.flashcore.rms_norm(rows, weight, float(eps))
    else:
        out = layer_kernels.rms_norm_triton(rows, weight, float(eps))
    return out.view(hidden_states.shape)


def add_rms_norm(
    hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, rms_norm(total, weight, eps))`` with ``total = residual + hidden_states`` rounded to the dtype, in one
    kernel: a decoder layer's residual add after attention and the RMSNorm before its MLP, to :func:`rms_norm`'s bits.

    Args:
        hidden_states: ``[..., hidden]``, unit stride along ``hidden``; float16, bfloat16 or float32.
        residual: the same shape, dtype and device, unit stride along ``hidden``.
        weight, eps: as for :func:`rms_norm`.

    Returns:
        Two new contiguous tensors of ``hidden_states``' shape and dtype: the sum and its norm.
    """
    _check_norm(hidden_states, "hidden_states", weight, eps)
    if not isinstance(residual, torch.Tensor) or residual.shape != hidden_states.shape:
        shape = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise ValueError(f"residual must have hidden_states' shape {tuple(hidden_states.shape)}, got {shape}")
    _check_like(hidden_states, "hidden_states", residual=residual)
    hidden = hidden_states.shape[-1]
    rows, residual_rows = hidden_states.reshape(-1, hidden), residual.reshape(-1, hidden)
    # contiguous, and written into by the op as the GEMVs' outs are (see the comment above their ops)
    total = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    out = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    if torch.compiler.is_compiling():
        torch.ops.flashcore.add_rms_norm(rows, residual_rows, weight, float(eps), total, out)
    else:
        layer_kernels.add_rms_norm_triton(rows, residual_rows, weight, float(eps), total, out)
    return total.view(hidden_states.shape), out.view(hidden_states.shape)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with the activation rounded to the dtype first: HF's ``act_fn(gate_proj(x)) * up_proj(x)``.

    Args:
        gate: ``[..., width]``, unit stride along ``width``; float16, bfloat16 or float32. May be a slice of a wider
            tensor (the gate half of a fused gate/up projection).
        up: the same shape, dtype and device.

    Returns:
        A new contiguous tensor of ``gate``'s shape and dtype.
    """
    _check_runs(gate, "gate")
    if up.shape != gate.shape:
        raise ValueError(f"up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    _check_like(gate, "gate", up=up)
    width = gate.shape[-1]
    gate_rows, up_rows = gate.reshape(-1, width), up.reshape(-1, width)
    if torch.compiler.is_compiling():
        out = torch.ops.flashcore.silu_and_mul(gate_rows, up_rows)
    else:
        out = layer_kernels.silu_and_mul_triton(gate_rows, up_rows)
    return out.view(gate.shape)


def apply_rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate_half(x) * sin`` for the query and the key: HF's ``apply_rotary_pos_emb``.

    Args:
        query: ``[B, H_q, S, D]``, unit stride along D (HF's ``q_proj(x).view(...).transpose(1, 2)`` is fine);
            float16, bfloat16 or float32; D even.
        key: ``[B, H_kv, S, D]``, same dtype, device and stride rule.
        cos: ``[B, S, D]`` or ``[1, S, D]``, the model's rotary embedding for these positions, same dtype.
        sin: like ``cos``, with its strides.

    Returns:
        ``(query, key)`` rotated: new contiguous tensors of the inputs' shapes, the layout the attention kernels
        read, so that a prefill's attention copies neither (NOTES.md, entry 67).
    """
    _check_runs(query, "query")
    for name, tensor in (("query", query), ("key", key)):
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {tuple(tensor.shape)}")
    batch, _, num_tokens, head_dim = query.shape
    if key.shape[0] != batch or key.shape[2:] != (num_tokens, head_dim):
        raise ValueError(f"key must be [B, H_kv, S, D] to match query {tuple(query.shape)}, got {tuple(key.shape)}")
    if head_dim % 2:
        raise ValueError(f"the rotary embedding pairs halves of D: D must be even, got {head_dim}")
    if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1:] != (num_tokens, head_dim):
        raise ValueError(
            f"cos must be [B, S, D] or [1, S, D] = [{batch} or 1, {num_tokens}, {head_dim}], got {tuple(cos.shape)}"
        )
    if sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(
            f"sin must have cos's shape {tuple(cos.shape)} and strides {cos.stride()}, got {tuple(sin.shape)} and "
            f"{sin.stride()}; pass the pair the model's rotary embedding returns"
        )
    _check_like(query, "query", key=key, cos=cos, sin=sin)
    if torch.compiler.is_compiling():
        rotated = torch.ops.flashcore.apply_rotary_embedding(query, key, cos, sin)
    else:
        rotated = layer_kernels.rotary_embedding_triton(query, key, cos, sin)
    return rotated[0], rotated[1]


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rotated: int | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a single row of ``x``: a decode step's projection at batch 1.

    Args:
        x: ``[..., K]`` holding one row (every leading dim 1, e.g. ``[1, 1, K]``); float16, bfloat16 or float32.
        weight: ``[N, K]``, unit stride along K (an ``nn.Linear``'s weight, or a row slice of a fused one); same
            dtype and device.
        bias: ``[N]`` or None, same dtype and device.
        norm_weight: ``[K]`` or None. With it the projection's input is ``rms_norm(x, norm_weight, eps)``, computed
            inside the GEMV with the norm's roundings (an input value may round the other way than
            :func:`rms_norm`'s, which sums the squares in another order): HF's ``q_proj(input_layernorm(x))``.
        eps: the norm's, >= 0; used only with ``norm_weight``.
        residual: ``[..., N]`` of the output's shape, contiguous, or None. Added to the rounded projection and
            rounded again: HF's ``residual + o_proj(x)``.
        cos: ``[..., D]`` holding one row (the rotary embedding of this token's position, as the model's rotary
            embedding returns it), or None. With it the outputs ``[0, rotated)``, heads of D, get the rotary
            embedding with :func:`apply_rotary_embedding`'s roundings, to its bits: HF's q/k/v projection, then
            ``apply_rotary_pos_emb``, where ``rotated`` covers q and k. D must be a multiple of 8
            (:func:`gemv_can_rotate`).
        sin: like ``cos``; both or neither.
        rotated: a multiple of D in ``(0, N]``; None: N. Used only with ``cos``.

    Returns:
        A new contiguous ``[..., N]`` tensor of ``x``'s dtype: the products summed in fp32, plus the bias, rounded
        once (then rotated, each product rounded; then plus the residual, rounded).
    """
    _check_runs(x, "x")
    _check_one_row(x, "x")
    row = x.reshape(-1)
    bias, residual = _check_projection(x, "x", weight, bias, residual)
    if norm_weight is not None:
        _check_norm_weight(x, norm_weight, eps)
    head_dim, rotated = _check_rotary(x, 1, weight.shape[0], cos, sin, rotated, whole=1)
    if cos is not None and not gemv_can_rotate(head_dim):
        raise ValueError(
            f"the GEMV rotates heads whose D is a multiple of {gemv_kernels.BLOCK_N}, got D = {head_dim}; "
            f"apply_rotary_embedding takes any even D"
        )
    if torch.compiler.is_compiling():
        out = row.new_empty(weight.shape[:1])
        torch.ops.flashcore.gemv(row, weight, bias, residual, norm_weight, float(eps), cos, sin, rotated, out)
    else:
        out = gemv_kernels.gemv_triton(
            row, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual, cos=cos, sin=sin, rotated=rotated
        )
    return out.view(*x.shape[:-1], weight.shape[0])


def gemv_can_rotate(head_dim: int) -> bool:
    """Whether :func:`gemv` can apply the rotary embedding to heads of ``head_dim``: a multiple of its 8 outputs per
    program, so that a program holds both halves' rows of the pairs it owns."""
    return head_dim % gemv_kernels.BLOCK_N == 0


def silu_and_mul_gemv(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gemv(silu_and_mul(gate, up), weight, bias, residual=residual)`` in one kernel, to the same bits: a SwiGLU
    MLP's down projection at batch 1, which computes its input from the gate and up rows as it reads them.

    Args:
        gate: ``[..., K]`` holding one row, unit stride along K; may be a slice of a fused gate/up projection.
        up: the same shape, dtype and device.
        weight, bias, residual: as for :func:`gemv`.

    Returns:
        A new contiguous ``[..., N]`` tensor of ``gate``'s dtype.
    """
    _check_runs(gate, "gate")
    _check_one_row(gate, "gate")
    if up.shape != gate.shape:
        raise ValueError(f"up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    _check_like(gate, "gate", up=up)
    bias, residual = _check_projection(gate, "gate", weight, bias, residual)
    gate_row, up_row = gate.reshape(-1), up.reshape(-1)
    if torch.compiler.is_compiling():
        out = gate_row.new_empty(weight.shape[:1])
        torch.ops.flashcore.silu_and_mul_gemv(gate_row, up_row, weight, bias, residual, out)
    else:
        out = gemv_kernels.gemv_triton(gate_row, weight, bias, up=up_row, residual=residual)
    return out.view(*gate.shape[:-1], weight.shape[0])


def rows_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    up: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rotated: int | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most ``ROWS_GEMM_MAX_ROWS`` (16) rows of ``x``, on tensor cores: a decode
    step's projection at a batch of a few rows. With ``up``, of ``silu_and_mul(x, up)``: a SwiGLU MLP's down
    projection, without its input written and read back. With ``norm_weight`` and ``cos``/``sin``, of the RMSNorm of
    ``x``, its first outputs rotated: the q/k/v projection between the layer's norm and its attention. With
    ``swiglu``, ``silu_and_mul(gate, up)`` of a fused gate/up projection's two halves, which are not written.

    Plain calls (with ``residual`` or ``swiglu`` at most) run on the TMA kernel where :func:`rows_gemm_streams` (an
    sm_90 GPU, fp16/bf16: ``flashcore/kernels/gluon_sm90/rows_gemm.py``), the rest on the Triton kernel; with
    ``swiglu`` there, the GEMM and :func:`silu_and_mul` run one after the other.

    Args:
        x: ``[..., K]`` of 1 to 16 rows (the leading dims' product), unit stride along K, rows at one stride (a
            slice of a fused gate/up projection's output is); float16, bfloat16 or float32.
        weight: ``[N, K]``, unit stride along K; same dtype and device.
        bias: ``[N]`` or None, same dtype and device.
        up: ``x``'s shape, dtype and device, or None. With it the input is ``silu_and_mul(x, up)``, computed with
            :func:`silu_and_mul`'s roundings, to its bits.
        residual: ``[..., N]`` of the output's shape, or None. Added to the rounded projection and rounded again:
            HF's ``residual + down_proj(x)``.
        norm_weight: ``[K]`` or None (not with ``up``). With it the input is ``rms_norm(x, norm_weight, eps)``, as
            :func:`gemv` computes it: the norm's roundings, each row's squares summed in another order than
            :func:`rms_norm`'s, so an input value may round the other way.
        eps: the norm's, >= 0; used only with ``norm_weight``.
        cos: ``[..., D]`` holding one row of the rotary embedding per row of ``x`` (the model's rotary embedding of
            the rows' positions, e.g. ``[B, 1, D]`` at a decode step), rows at one stride, or None. With it the
            outputs ``[0, rotated)``, heads of D, get the rotary embedding with :func:`apply_rotary_embedding`'s
            roundings, to its bits.
        sin: like ``cos``, with its strides; both or neither.
        rotated: a multiple of D and of 64 (:func:`rows_gemm_can_rotate`) in ``(0, N]``; None: N. Used only with
            ``cos``.
        swiglu: the weight's rows (N even) are a gate projection's, then an up projection's: the output is
            ``silu_and_mul(gate, up)`` of the two rounded products, ``[..., N / 2]``, with its roundings; the gate's
            and up's outputs have the bits of the call without it. Not with ``up``, ``norm_weight``, ``cos`` or
            ``residual``.

    Returns:
        A new contiguous ``[..., N]`` tensor (``[..., N / 2]`` with ``swiglu``) of ``x``'s dtype: the products summed
        in fp32 (in slices of K, the slices added in K order), plus the bias, rounded once (then rotated, each
        product rounded; then plus the residual, rounded).
    """
    _check_runs(x, "x")
    if x.dim() == 0 or not 0 < x.numel() // max(x.shape[-1], 1) <= ROWS_GEMM_MAX_ROWS:
        raise ValueError(
            f"rows_gemm takes 1 to {ROWS_GEMM_MAX_ROWS} rows: x must be [..., K] whose leading dims multiply to at "
            f"most {ROWS_GEMM_MAX_ROWS}, got shape {tuple(x.shape)}; use F.linear for more rows"
        )
    rows, k = x.numel() // x.shape[-1], x.shape[-1]
    if up is not None:
        if not isinstance(up, torch.Tensor) or up.shape != x.shape:
            shape = tuple(up.shape) if isinstance(up, torch.Tensor) else type(up).__name__
            raise ValueError(f"up must have x's shape {tuple(x.shape)} or be None, got {shape}")
        _check_like(x, "x", up=up)
    bias, residual = _check_projection(x, "x", weight, bias, residual)
    if norm_weight is not None:
        if up is not None:
            raise ValueError("rows_gemm takes up (a SwiGLU's down projection) or norm_weight, not both")
        _check_norm_weight(x, norm_weight, eps)
    if swiglu and (up is not None or norm_weight is not None or cos is not None or residual is not None):
        raise ValueError("rows_gemm takes swiglu (a fused gate/up projection) alone: not with up, norm_weight, cos "
                         "or residual")  # fmt: skip
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"swiglu needs a weight of gate and up rows, N even, got N = {weight.shape[0]}")
    head_dim, rotated = _check_rotary(x, rows, weight.shape[0], cos, sin, rotated, rows_gemm_kernels.BLOCK_N)
    cos_rows = sin_rows = None
    if cos is not None:
        try:
            cos_rows, sin_rows = cos.view(rows, head_dim), sin.view(rows, head_dim)
        except RuntimeError:
            raise ValueError(
                f"cos and sin must hold their rows at one stride, got strides {cos.stride()}; pass .contiguous()"
            ) from None
    x_rows = x.reshape(rows, k)
    up_rows = up.reshape(rows, k) if up is not None else None
    residual_rows = residual.view(rows, weight.shape[0]) if residual is not None else None
    n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = x_rows.new_empty(rows, n_out)
    if torch.compiler.is_compiling():
        torch.ops.flashcore.rows_gemm(
            x_rows, up_rows, weight, bias, residual_rows, norm_weight, float(eps), cos_rows, sin_rows, rotated, swiglu,
            out,
        )  # fmt: skip
    else:
        _run_rows_gemm(x_rows, up_rows, weight, bias, residual_rows, norm_weight, eps, cos_rows, sin_rows, rotated,
                       swiglu, out)  # fmt: skip
    return out.view(*x.shape[:-1], n_out)


def rows_gemm_streams(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """Whether :func:`rows_gemm` runs ``x @ weight.T`` (``x`` of 1 to 16 rows) on the TMA kernel, whose weight
    stream keeps more bytes in flight than the Triton kernel's: the model integration then gives it the o and gate/up
    projections of a decode step of a few rows too (``benchmarks/NOTES.md``, entry 72)."""
    return tma_rows_gemm_kernels.supports(x.reshape(-1, x.shape[-1]), weight, swiglu)


def _run_rows_gemm(x, up, weight, bias, residual, norm_weight, eps, cos, sin, rotated, swiglu, out) -> None:
    """:func:`rows_gemm`'s kernels, for ``[M, K]`` operands it validated: plain calls (``residual`` or ``swiglu`` at
    most) on the TMA kernel where it takes them, the rest on the Triton kernel."""
    plain = up is None and norm_weight is None and cos is None
    if plain and tma_rows_gemm_kernels.supports(x, weight, swiglu):
        tma_rows_gemm_kernels.tma_rows_gemm(x, weight, bias, residual=residual, swiglu=swiglu, out=out)
    elif swiglu:
        gate, up = rows_gemm_kernels.rows_gemm_triton(x, weight, bias).chunk(2, dim=-1)
        layer_kernels.silu_and_mul_triton(gate, up, out=out)
    else:
        rows_gemm_kernels.rows_gemm_triton(
            x, weight, bias, up=up, residual=residual, norm_weight=norm_weight, eps=eps, cos=cos, sin=sin,
            rotated=rotated, out=out,
        )  # fmt: skip


def rows_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """A SwiGLU MLP of at most ``ROWS_GEMM_MAX_ROWS`` (16) rows, ``residual + down(silu_and_mul(gate, up))`` where
    ``gate`` and ``up`` are a fused gate/up projection's halves: :func:`rows_gemm` with ``swiglu``, then
    :func:`rows_gemm` of the down projection with ``residual``, to their bits.

    Where :func:`rows_mlp_fuses` (an sm_90 GPU, fp16/bf16, a grid of at most one program per SM) the two run as one
    launch (``flashcore/kernels/gluon_sm90/rows_mlp.py``), whose down projection starts on a K slice as soon as that
    slice's activations are written; elsewhere as the two :func:`rows_gemm` calls.

    Args:
        x: ``[..., H]`` of 1 to 16 rows, unit stride along H, rows at one stride; float16, bfloat16 or float32.
        gate_up_weight: ``[2 I, H]``: the gate projection's rows, then the up projection's; same dtype and device.
        gate_up_bias: ``[2 I]`` or None.
        down_weight: ``[H, I]``, unit stride along I.
        down_bias: ``[H]`` or None.
        residual: ``x``'s shape, or None; added to the rounded down projection and rounded again.

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype.
    """
    _check_runs(x, "x")
    if x.dim() == 0 or not 0 < x.numel() // max(x.shape[-1], 1) <= ROWS_GEMM_MAX_ROWS:
        raise ValueError(
            f"rows_mlp takes 1 to {ROWS_GEMM_MAX_ROWS} rows: x must be [..., H] whose leading dims multiply to at "
            f"most {ROWS_GEMM_MAX_ROWS}, got shape {tuple(x.shape)}"
        )
    hidden = x.shape[-1]
    if not _is_matrix(gate_up_weight) or gate_up_weight.shape[0] % 2 or gate_up_weight.shape[1] != hidden:
        raise ValueError(
            f"gate_up_weight must be [2 I, H] with H = x.shape[-1] = {hidden}, the gate's rows then the up's, got "
            f"{_shape_of(gate_up_weight)}"
        )
    intermediate = gate_up_weight.shape[0] // 2
    if not _is_matrix(down_weight) or down_weight.shape != (hidden, intermediate):
        raise ValueError(f"down_weight must be [H, I] = [{hidden}, {intermediate}], got {_shape_of(down_weight)}")
    expected = {"gate_up_bias": (2 * intermediate,), "down_bias": (hidden,), "residual": tuple(x.shape)}
    given = {"gate_up_bias": gate_up_bias, "down_bias": down_bias, "residual": residual}
    for name, tensor in given.items():
        if tensor is not None and (not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected[name]):
            raise ValueError(f"{name} must be {list(expected[name])} or None, got {_shape_of(tensor)}")
    present = {name: tensor for name, tensor in given.items() if tensor is not None}
    _check_like(x, "x", gate_up_weight=gate_up_weight, down_weight=down_weight, **present)
    rows = x.numel() // x.shape[-1]
    x_rows = x.reshape(rows, x.shape[-1])
    residual_rows = residual.reshape(rows, x.shape[-1]) if residual is not None else None
    out = x_rows.new_empty(rows, x.shape[-1])
    if torch.compiler.is_compiling():
        torch.ops.flashcore.rows_mlp(x_rows, gate_up_weight, gate_up_bias, down_weight, down_bias, residual_rows, out)
    else:
        _run_rows_mlp(x_rows, gate_up_weight, gate_up_bias, down_weight, down_bias, residual_rows, out)
    return out.view(x.shape)


def rows_mlp_fuses(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> bool:
    """Whether :func:`rows_mlp` runs as one launch on ``x`` (1 to 16 rows) and these weights."""
    return tma_rows_mlp_kernels.supports(x.reshape(-1, x.shape[-1]), gate_up_weight, down_weight)


def _run_rows_mlp(x, gate_up_weight, gate_up_bias, down_weight, down_bias, residual, out) -> None:
    if rows_mlp_fuses(x, gate_up_weight, down_weight):
        tma_rows_mlp_kernels.tma_rows_mlp(
            x, gate_up_weight, gate_up_bias, down_weight, down_bias, residual=residual, out=out
        )
        return
    activated = x.new_empty(x.shape[0], gate_up_weight.shape[0] // 2)
    _run_rows_gemm(x, None, gate_up_weight, gate_up_bias, None, None, 0.0, None, None, 0, True, activated)
    _run_rows_gemm(activated, None, down_weight, down_bias, residual, None, 0.0, None, None, 0, False, out)


def rows_gemm_can_rotate(rotated: int) -> bool:
    """Whether :func:`rows_gemm` can apply the rotary embedding to its first ``rotated`` outputs: whole programs of
    its 64 weight rows, so that a program holds both halves' rows of the pairs it owns."""
    return rotated > 0 and rotated % rows_gemm_kernels.BLOCK_N == 0


def _is_matrix(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dim() == 2


def _shape_of(value) -> object:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _check_norm_weight(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> None:
    if not isinstance(norm_weight, torch.Tensor) or norm_weight.shape != x.shape[-1:]:
        shape = tuple(norm_weight.shape) if isinstance(norm_weight, torch.Tensor) else type(norm_weight).__name__
        raise ValueError(f"norm_weight must be [K] = [{x.shape[-1]}] or None, got {shape}")
    _check_like(x, "x", norm_weight=norm_weight)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


def _check_rotary(
    x: torch.Tensor,
    rows: int,
    n: int,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rotated: int | None,
    whole: int,
) -> tuple[int, int]:
    """Checks a projection's rotary embedding, the GEMV's (``rows`` 1) or the few-row GEMM's: ``cos`` and ``sin``
    hold one row of D per row of ``x``, with the same shape and strides; ``rotated`` covers whole heads and whole
    kernel programs of ``whole`` outputs. Returns ``(D, rotated)``, ``(0, 0)`` without them."""
    if cos is None and sin is None:
        return 0, 0
    if cos is None or sin is None:
        raise ValueError("pass both cos and sin for the rotary embedding, or neither")
    head_dim = cos.shape[-1] if isinstance(cos, torch.Tensor) and cos.dim() > 0 else 0
    for name, tensor in (("cos", cos), ("sin", sin)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.numel() != rows * head_dim:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(
                f"{name} must be [..., D] holding one row per row of x ({rows}), e.g. [B, 1, D] at a decode step, "
                f"got {shape}"
            )
    if sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(
            f"sin must have cos's shape {tuple(cos.shape)} and strides {cos.stride()}, got {tuple(sin.shape)} and "
            f"{sin.stride()}; pass the pair the model's rotary embedding returns"
        )
    if head_dim % 2:
        raise ValueError(f"the rotary embedding pairs halves of D: D must be even, got {head_dim}")
    _check_like(x, "x", cos=cos, sin=sin)
    rotated = n if rotated is None else rotated
    if not (isinstance(rotated, int) and 0 < rotated <= n and rotated % head_dim == 0 and rotated % whole == 0):
        multiple = f"D = {head_dim}" if whole == 1 else f"D = {head_dim} and of {whole}"
        raise ValueError(
            f"rotated must be a multiple of {multiple} in (0, N = {n}] or None, got {rotated!r}; "
            f"apply_rotary_embedding takes any heads"
        )
    return head_dim, rotated


def _check_one_row(x: torch.Tensor, name: str) -> None:
    if x.dim() == 0 or x.numel() != x.shape[-1]:
        raise ValueError(
            f"the GEMV takes one row: {name} must be [..., K] with every leading dim 1, got shape {tuple(x.shape)}; "
            f"use F.linear for more rows"
        )


def _check_projection(
    x: torch.Tensor, name: str, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Checks a projection's weight, bias and residual against its input; returns the bias and the residual as the
    kernels take them (the residual contiguous, flattened)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be [N, K] with K = {name}.shape[-1] = {x.shape[-1]}, got {shape}")
    tensors = {"weight": weight}
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]:
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must be [N] = [{weight.shape[0]}] or None, got {shape}")
        tensors["bias"] = bias
    if residual is not None:
        out_shape = (*x.shape[:-1], weight.shape[0])
        if not isinstance(residual, torch.Tensor) or residual.shape != out_shape:
            shape = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
            raise ValueError(f"residual must have the output's shape {out_shape} or be None, got {shape}")
        tensors["residual"] = residual
    _check_like(x, name, **tensors)
    return bias, residual.reshape(-1) if residual is not None else None


def _check_norm(hidden_states: torch.Tensor, name: str, weight: torch.Tensor, eps: float) -> None:
    _check_runs(hidden_states, name)
    hidden = hidden_states.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [hidden] = [{hidden}] to match {name}, got {tuple(weight.shape)}")
    _check_like(hidden_states, name, weight=weight)
    if hidden > layer_kernels.MAX_NORM_WIDTH:
        limit = layer_kernels.MAX_NORM_WIDTH
        raise ValueError(f"rms_norm holds a row in registers: hidden must be <= {limit}, got {hidden}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


def _check_runs(tensor: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not (tensor.is_cuda or triton_interpreter_enabled()):
        raise NotImplementedError(
            f"flashcore's layer kernels run on CUDA tensors, or on the CPU with TRITON_INTERPRET=1 set before triton "
            f"is imported; {name} is on {tensor.device}. On the CPU keep the model's own layers: "
            f"apply_flashcore_to_llama(model, layer_kernels=False)"
        )
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} dtype must be one of {SUPPORTED_DTYPES}, got {tensor.dtype}")


def _check_like(reference: torch.Tensor, reference_name: str, **tensors: torch.Tensor) -> None:
    """Same dtype and device as the reference, and unit stride along the last dim, for all of them."""
    for name, tensor in {reference_name: reference, **tensors}.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != reference.dtype:
            raise TypeError(f"{name} dtype {tensor.dtype} must match {reference_name}'s {reference.dtype}")
        if tensor.device != reference.device:
            raise ValueError(f"{name} is on {tensor.device} but {reference_name} is on {reference.device}")
        if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(
                f"{name} must have unit stride along its last dim, got strides {tensor.stride()}; pass .contiguous()"
            )


@torch.library.custom_op("flashcore::rms_norm", mutates_args=())
def _rms_norm_op(rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    with on_device_of(rows):
        return layer_kernels.rms_norm_triton(rows, weight, eps)


@_rms_norm_op.register_fake
def _(rows, weight, eps):
    return rows.new_empty(rows.shape)


@torch.library.custom_op("flashcore::add_rms_norm", mutates_args=("total", "out"))
def _add_rms_norm_op(
    rows: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, total: torch.Tensor, out: torch.Tensor
) -> None:
    with on_device_of(rows):
        layer_kernels.add_rms_norm_triton(rows, residual, weight, eps, total, out)


@torch.library.custom_op("flashcore::silu_and_mul", mutates_args=())
def _silu_and_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    with on_device_of(gate):
        return layer_kernels.silu_and_mul_triton(gate, up)


@_silu_and_mul_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


# flexible_layout: inductor passes the inputs in the layout it has, where by default it gives each call an input of
# the exact strides eager had. That default made it compute the model's cos and sin again into a buffer of their own
# for every layer's call, one kernel per layer in a compiled decode step (NOTES.md, entry 55). The kernel takes any
# strides but a unit one along D, which the body checks.
@torch.library.custom_op("flashcore::apply_rotary_embedding", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _rotary_embedding_op(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_like(query, "query", key=key, cos=cos, sin=sin)
    with on_device_of(query):
        return layer_kernels.rotary_embedding_triton(query, key, cos, sin)


@_rotary_embedding_op.register_fake
def _(query, key, cos, sin):
    return query.new_empty(query.shape), key.new_empty(key.shape)  # contiguous, as the kernel returns


# The GEMVs write into an ``out`` their caller allocates, rather than return a new tensor, for inductor: it prints
# an opaque op's inputs recursively (``__str__``), and a chain of GEMVs that return their outputs, each residual read
# by two of them, made that string grow about 26-fold per layer, until HF's compiled ``generate`` of a 16-layer model
# hung in it (NOTES.md, entry 55). An ``out`` allocated in the graph is a buffer of its own, which inductor prints by
# name: the string stays the same length at any depth (``benchmarks/probes/inductor_ir_str_growth.py``, entry 56).
# flexible_layout as for the RoPE op above, for the same cos and sin; the body checks the unit strides.
@torch.library.custom_op("flashcore::gemv", mutates_args=("out",), tags=(torch.Tag.flexible_layout,))
def _gemv_op(
    row: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rotated: int,
    out: torch.Tensor,
) -> None:
    vectors = dict(residual=residual, cos=cos, sin=sin, out=out)
    _check_like(row, "row", weight=weight, **{name: t for name, t in vectors.items() if t is not None})
    with on_device_of(row):
        gemv_kernels.gemv_triton(
            row, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual, cos=cos, sin=sin,
            rotated=rotated, out=out,
        )  # fmt: skip


@torch.library.custom_op("flashcore::silu_and_mul_gemv", mutates_args=("out",))
def _silu_and_mul_gemv_op(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    with on_device_of(gate):
        gemv_kernels.gemv_triton(gate, weight, bias, up=up, residual=residual, out=out)


@torch.library.custom_op("flashcore::rows_mlp", mutates_args=("out",))
def _rows_mlp_op(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    with on_device_of(x):
        _run_rows_mlp(x, gate_up_weight, gate_up_bias, down_weight, down_bias, residual, out)


# flexible_layout as for the GEMV's op, for the same cos and sin; the body checks the unit strides.
@torch.library.custom_op("flashcore::rows_gemm", mutates_args=("out",), tags=(torch.Tag.flexible_layout,))
def _rows_gemm_op(
    x: torch.Tensor,
    up: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rotated: int,
    swiglu: bool,
    out: torch.Tensor,
) -> None:
    operands = dict(up=up, residual=residual, norm_weight=norm_weight, cos=cos, sin=sin, out=out)
    _check_like(x, "x", weight=weight, **{name: t for name, t in operands.items() if t is not None})
    # The kernel reads sin at cos's row stride and writes out densely; flexible_layout leaves both to inductor.
    if cos is not None and sin.stride() != cos.stride():
        raise ValueError(f"sin must have cos's strides {cos.stride()}, got {sin.stride()}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    with on_device_of(x):
        _run_rows_gemm(x, up, weight, bias, residual, norm_weight, eps, cos, sin, rotated, swiglu, out)
