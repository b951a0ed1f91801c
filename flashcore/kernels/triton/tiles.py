"""The Triton attention body's ``@triton.jit`` helpers: masked tile loads and the online-softmax loop over key tiles."""

import triton
import triton.language as tl


@triton.jit
def _load_tile(ptrs, mask_rows, mask_d, HAS_ROW_MASK: tl.constexpr, HAS_D_MASK: tl.constexpr):
    """Loads a [rows, HEAD_DIM_PAD] tile; masked-off elements read as 0 so that garbage (maybe NaN) never
    enters a dot product. Masks are only built when the shape needs them, so aligned tiles load unmasked."""
    if HAS_ROW_MASK and HAS_D_MASK:
        tile = tl.load(ptrs, mask=mask_rows[:, None] & mask_d[None, :], other=0.0)
    elif HAS_ROW_MASK:
        tile = tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
    elif HAS_D_MASK:
        tile = tl.load(ptrs, mask=mask_d[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _attend_tiles(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32: unnormalised output
    m_i,  # [BLOCK_M] fp32: running row max of the log2-scaled scores
    l_i,  # [BLOCK_M] fp32: running softmax denominator
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    k_ptr,  # key rows of one (batch, kv head) source: the cache, or the new tokens
    v_ptr,
    stride_k_n,
    stride_k_d,
    stride_v_n,
    stride_v_d,
    start,  # first key index visited (local to the source)
    end,  # one past the last key index visited
    num_keys,  # keys at index >= num_keys are not valid (only read when MASK_LENGTH)
    key_pos0,  # absolute sequence position of the source's index 0
    query_pos,  # [BLOCK_M] absolute position of each query row
    qk_scale,  # softmax scale * log2(e), so that exp2 can replace exp
    window,
    offs_d,
    mask_d,
    BLOCK_N: tl.constexpr,
    HAS_D_MASK: tl.constexpr,
    MASK_LENGTH: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    MASK_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax pass over key tiles [start, end). The MASK_* flags are chosen per stage so that
    only the tiles that can hold a masked element (the tail, the diagonal, the window edge) pay for it."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < num_keys
        k_offsets = cols[:, None] * stride_k_n + offs_d[None, :] * stride_k_d
        k = _load_tile(k_ptr + k_offsets, mask_n, mask_d, MASK_LENGTH, HAS_D_MASK)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p, alpha, m_i, l_i = _online_softmax(
            scores, m_i, l_i, cols, mask_n, key_pos0, query_pos, qk_scale, window, MASK_LENGTH, MASK_CAUSAL, MASK_WINDOW
        )
        v_offsets = cols[:, None] * stride_v_n + offs_d[None, :] * stride_v_d
        v = _load_tile(v_ptr + v_offsets, mask_n, mask_d, MASK_LENGTH, HAS_D_MASK)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _attend_loaded_tile(
    acc, m_i, l_i, q, k, v, cols, mask_n, key_pos0, query_pos, qk_scale, window,
    MASK_CAUSAL: tl.constexpr, MASK_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a K/V tile already in registers (keys ``cols``, valid where ``mask_n``)."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    p, alpha, m_i, l_i = _online_softmax(
        scores, m_i, l_i, cols, mask_n, key_pos0, query_pos, qk_scale, window, True, MASK_CAUSAL, MASK_WINDOW
    )
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _online_softmax(
    scores, m_i, l_i, cols, mask_n, key_pos0, query_pos, qk_scale, window,
    MASK_LENGTH: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_WINDOW: tl.constexpr,
):  # fmt: skip
    """Masks one tile's raw scores and folds them into the running row max and sum.

    Returns the tile's unnormalised probabilities, the factor that rescales what was accumulated before, and
    the new max and sum."""
    if MASK_LENGTH or MASK_CAUSAL or MASK_WINDOW:
        key_pos = key_pos0 + cols
        is_visible = tl.full(scores.shape, 1, tl.int1)
        if MASK_LENGTH:
            is_visible = is_visible & mask_n[None, :]
        if MASK_CAUSAL:
            is_visible = is_visible & (key_pos[None, :] <= query_pos[:, None])
        if MASK_WINDOW:
            is_visible = is_visible & (key_pos[None, :] > query_pos[:, None] - window)
        scores = tl.where(is_visible, scores, float("-inf"))
    # The scale is applied inside exp2's argument so that it fuses with the max subtraction (one FMA).
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    # A row with nothing visible yet keeps m = -inf; shifting by 0 instead keeps exp2 finite (0, not NaN).
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(scores * qk_scale - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i
