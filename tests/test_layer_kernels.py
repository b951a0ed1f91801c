"""flashcore's layer kernels (``flashcore.layer_ops``) and ``apply_flashcore_to_llama(layer_kernels=True)``.

Each op is checked against transformers' own eager code for the same layer (``LlamaRMSNorm``, ``silu(gate) * up``,
``apply_rotary_pos_emb``), which is what it replaces, on fresh random inputs of odd sizes and strides. The
kernels round where that code rounds, so the bound is an ulp or two of the dtype, not a guess. A patched tiny
model must then give stock's greedy tokens, and on the GPU a bf16 model must give the same tokens eagerly,
graph-replayed and compiled (issue 5's "tokens identical to eager flashcore").
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import DTYPES, ON_GPU, randn
from hf_models import PAD_ID, bf16_llama, random_prompts, seed_of, tiny_llama, tiny_same_attention_model
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from flashcore import layer_ops
from flashcore.integrations import layer_kernels as integration_layer_kernels
from flashcore.integrations.decode_session import DecodeSession
from flashcore.integrations.llama import (
    CACHE_ARGUMENT_NAME,
    FlashCoreCache,
    apply_flashcore_to_llama,
    remove_flashcore,
)
from flashcore.kernels.triton import gemv as gemv_kernels
from flashcore.kernels.triton import layer_kernels
from flashcore.kernels.triton import rows_gemm as rows_gemm_kernels


def ulps(dtype: torch.dtype, count: float) -> dict:
    """``count`` units in the last place of ``dtype``, relative, for ``assert_close``; the absolute part only
    covers results that cancel to near zero."""
    eps = torch.finfo(dtype).eps
    return dict(rtol=count * eps, atol=count * eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 96), (2, 7, 1000), (1, 2, 2048)])
def test_rms_norm_matches_llama_rms_norm(shape, dtype, device, generator):
    x = randn(shape, generator=generator, dtype=dtype, device=device) * 3
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(device=device, dtype=dtype)
    norm.weight.data = randn(shape[-1:], generator=generator, dtype=dtype, device=device)

    out = layer_ops.rms_norm(x, norm.weight, norm.variance_epsilon)

    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    # The mean square's summation order and rsqrt differ: one ulp before the rounding to the dtype, so at most
    # one ulp of the dtype after it, and one more from the product with the weight.
    torch.testing.assert_close(out, norm(x), **ulps(dtype, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_rows(dtype, device, generator):
    """Rows of a wider tensor (a column slice) are read in place, with their row stride."""
    wide = randn((6, 160), generator=generator, dtype=dtype, device=device)
    x = wide[:, 16:144]
    weight = randn((128,), generator=generator, dtype=dtype, device=device)
    norm = LlamaRMSNorm(128, eps=1e-6).to(device=device, dtype=dtype)
    norm.weight.data = weight
    torch.testing.assert_close(layer_ops.rms_norm(x, weight, 1e-6), norm(x), **ulps(dtype, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 96), (2, 7, 1000), (16, 1, 2048)])
def test_add_rms_norm_is_the_add_then_rms_norm(shape, dtype, device, generator):
    """The residual add after attention and the norm before the MLP in one kernel: the sum is torch's (one rounding
    of the exact sum), and the norm is ``rms_norm``'s of that sum to the bit (same kernel code after the add), so
    also within ``LlamaRMSNorm``'s bound. The inputs are rows of wider tensors, read with their strides."""
    wide = randn((2, *shape[:-1], shape[-1] + 16), generator=generator, dtype=dtype, device=device) * 3
    x, residual = wide[0, ..., 8 : 8 + shape[-1]], wide[1, ..., : shape[-1]]
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(device=device, dtype=dtype)
    norm.weight.data = randn(shape[-1:], generator=generator, dtype=dtype, device=device)

    total, out = layer_ops.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)

    for result in (total, out):
        assert result.shape == x.shape and result.dtype == dtype and result.is_contiguous()
    assert torch.equal(total, residual + x)
    assert torch.equal(out, layer_ops.rms_norm(residual + x, norm.weight, norm.variance_epsilon))
    torch.testing.assert_close(out, norm(residual + x), **ulps(dtype, 2))


def test_add_rms_norm_op_compiles_to_eager_bits(device, generator):
    """Under ``torch.compile`` the fused add and norm runs as ``flashcore::add_rms_norm``, which writes into the two
    outputs its caller allocates (as the GEMV ops do); opcheck checks that claim, and a fullgraph compile of a chain
    of them, each sum read by the next, gives the eager bits."""
    x = randn((3, 2, 96), generator=generator, dtype=torch.float32, device=device)
    weight = 1 + randn((96,), generator=generator, dtype=torch.float32, device=device) / 4
    rows = x.reshape(-1, 96)
    torch.library.opcheck(
        torch.ops.flashcore.add_rms_norm.default,
        (rows, rows * 2, weight, 1e-5, torch.empty_like(rows), torch.empty_like(rows)),
    )

    def chain(hidden):
        residual = hidden
        for _ in range(3):
            residual, hidden = layer_ops.add_rms_norm(hidden * 0.5, residual, weight, 1e-5)
        return residual, hidden

    torch._dynamo.reset()
    compiled = torch.compile(chain, fullgraph=True)(x)
    for got, expected in zip(compiled, chain(x), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 300), (1, 4, 2500)])
@pytest.mark.parametrize("layout", ["separate", "fused_halves"])
def test_silu_and_mul_matches_hf_swiglu(shape, layout, dtype, device, generator):
    if layout == "separate":
        gate = randn(shape, generator=generator, dtype=dtype, device=device) * 4
        up = randn(shape, generator=generator, dtype=dtype, device=device)
    else:  # the two halves of one fused gate/up projection's output, as fuse_projections splits it
        fused = randn((*shape[:-1], 2 * shape[-1]), generator=generator, dtype=dtype, device=device) * 4
        gate, up = fused.split(shape[-1], dim=-1)

    out = layer_ops.silu_and_mul(gate, up)

    # exp differs by an ulp before SiLU's rounding to the dtype: one ulp there, one more from the product.
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, **ulps(dtype, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "batch, tokens, q_heads, kv_heads, head_dim, cos_batch",
    [(1, 1, 32, 8, 64, 1), (2, 5, 6, 2, 16, 2), (3, 4, 4, 4, 128, 3), (2, 3, 9, 3, 40, 1)],
)
def test_rotary_embedding_matches_apply_rotary_pos_emb(
    batch, tokens, q_heads, kv_heads, head_dim, cos_batch, dtype, device, generator
):
    """Query and key as HF's projections give them (``[B, H, S, D]`` views of ``[B, S, H, D]``); cos/sin per row
    or broadcast over rows."""

    def projected(heads):
        return randn((batch, tokens, heads, head_dim), generator=generator, dtype=dtype, device=device).transpose(1, 2)

    query, key = projected(q_heads), projected(kv_heads)
    angles = randn((cos_batch, tokens, head_dim), generator=generator, dtype=torch.float32, device=device) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    rotated_query, rotated_key = layer_ops.apply_rotary_embedding(query, key, cos, sin)

    expected_query, expected_key = apply_rotary_pos_emb(query, key, cos, sin)
    for out, expected in ((rotated_query, expected_query), (rotated_key, expected_key)):
        assert out.shape == expected.shape and out.is_contiguous()  # what the attention kernels read
        # HF's roundings, each product and the sum: the kernel compiles without FMA contraction, so bit for bit.
        assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n, k, leading", [(1, 1, (1,)), (37, 100, (1, 1)), (300, 2500, (1,)), (5, 4500, (1, 1, 1))]
)  # K 2500 and 4500: more than one BLOCK_K step, and a ragged last one
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_gemv_matches_fp64_linear(n, k, leading, with_bias, dtype, device, generator):
    """Against ``x @ weight.T + bias`` in fp64. The kernel sums the products in fp32 and rounds once, so the bound is
    half an ulp of the dtype plus fp32's summation error over K terms (``K * eps32 * sum |w x|``). The weight is a row
    slice of a wider one, as a fused projection's is."""
    x = randn((*leading, k), generator=generator, dtype=dtype, device=device)
    wide = randn((n + 7, k), generator=generator, dtype=dtype, device=device) / k**0.5
    weight = wide[3 : 3 + n]
    bias = randn((n,), generator=generator, dtype=dtype, device=device) if with_bias else None

    out = layer_ops.gemv(x, weight, bias)

    assert out.shape == (*leading, n) and out.dtype == dtype and out.is_contiguous()
    x64, weight64 = x.reshape(-1).double(), weight.double()
    expected = weight64 @ x64 + (bias.double() if with_bias else 0)
    bound = torch.finfo(dtype).eps / 2 * expected.abs() + k * torch.finfo(torch.float32).eps * (
        weight64.abs() @ x64.abs()
    )
    error = (out.reshape(-1).double() - expected).abs()
    assert bool((error <= bound).all()), f"worst excess {float((error - bound).max())}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(37, 100), (300, 2500)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_gemv_folds_the_residual_add_and_the_swiglu(n, k, with_bias, dtype, device, generator):
    """The residual and the SwiGLU input inside the GEMV give the bits of the separate ops they replace: the GEMV,
    then PyTorch's ``residual + out`` (an fp32 add rounded once); ``silu_and_mul``, then the GEMV. Both checked
    against fp64 on their own above. The gate and up are the halves of one fused projection's output, as a decode
    step's are."""
    fused = randn((1, 1, 2 * k), generator=generator, dtype=dtype, device=device) * 4
    gate, up = fused.split(k, dim=-1)
    x = randn((1, 1, k), generator=generator, dtype=dtype, device=device)
    weight = randn((n, k), generator=generator, dtype=dtype, device=device) / k**0.5
    bias = randn((n,), generator=generator, dtype=dtype, device=device) if with_bias else None
    residual = randn((1, 1, n), generator=generator, dtype=dtype, device=device)

    added = layer_ops.gemv(x, weight, bias, residual=residual)
    down = layer_ops.silu_and_mul_gemv(gate, up, weight, bias)
    down_added = layer_ops.silu_and_mul_gemv(gate, up, weight, bias, residual=residual)

    assert torch.equal(added, residual + layer_ops.gemv(x, weight, bias))
    separate = layer_ops.gemv(layer_ops.silu_and_mul(gate, up), weight, bias)
    assert torch.equal(down, separate) and torch.equal(down_added, residual + separate)
    assert down_added.shape == (1, 1, n) and down_added.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(37, 100), (300, 2500), (5, 4500)])  # 4500: the norm's sum over two K steps
def test_gemv_folds_the_rms_norm(n, k, dtype, device, generator):
    """``gemv(x, W, norm_weight=w, eps=e)`` against fp64 ``W @ rms_norm(x, w, e)``, the norm's output taken from
    :func:`layer_ops.rms_norm` (itself checked against ``LlamaRMSNorm`` above). The GEMV sums the squares in another
    order, so an input value may round to its neighbour: the bound adds one ulp of every input to the GEMV's."""
    x = randn((1, 1, k), generator=generator, dtype=dtype, device=device) * 3
    norm_weight = 1 + randn((k,), generator=generator, dtype=dtype, device=device) / 4
    weight = randn((n, k), generator=generator, dtype=dtype, device=device) / k**0.5
    bias = randn((n,), generator=generator, dtype=dtype, device=device)

    out = layer_ops.gemv(x, weight, bias, norm_weight=norm_weight, eps=1e-5)

    normed64 = layer_ops.rms_norm(x, norm_weight, 1e-5).reshape(-1).double()
    weight64 = weight.double()
    expected = weight64 @ normed64 + bias.double()
    magnitude = weight64.abs() @ normed64.abs()
    eps = torch.finfo(dtype).eps
    bound = eps / 2 * expected.abs() + k * torch.finfo(torch.float32).eps * magnitude + eps * magnitude
    error = (out.reshape(-1).double() - expected).abs()
    assert bool((error <= bound).all()), f"worst excess {float((error - bound).max())}"


def test_gemv_ops_write_their_out_and_compile_to_eager_bits(device, generator):
    """Under ``torch.compile`` the GEMVs run as the custom ops ``flashcore::gemv`` and ``flashcore::silu_and_mul_gemv``,
    which write into an ``out`` the caller allocates (``mutates_args``: inductor then prints each output by name, not
    its inputs recursively; NOTES.md, entry 56). opcheck checks that claim, the fake and functionalization; a
    fullgraph compile of two layers' worth of them, each residual read by two GEMVs as in a decoder layer, gives the
    eager bits."""
    k, n = 64, 48
    x = randn((1, 1, k), generator=generator, dtype=torch.float32, device=device)
    norm_weight = 1 + randn((k,), generator=generator, dtype=torch.float32, device=device) / 4
    w_in = randn((2 * n, k), generator=generator, dtype=torch.float32, device=device) / k**0.5
    w_out = randn((k, n), generator=generator, dtype=torch.float32, device=device) / n**0.5
    bias = randn((k,), generator=generator, dtype=torch.float32, device=device)
    row, out = x.reshape(-1), torch.empty(2 * n, device=device)
    cos, sin = randn((2, 16), generator=generator, dtype=torch.float32, device=device)
    gemv_args = (row, w_in, None, None, norm_weight, 1e-5, cos, sin, n, out)
    torch.library.opcheck(torch.ops.flashcore.gemv.default, gemv_args)
    gate, up = layer_ops.gemv(x, w_in).reshape(-1).split(n)
    torch.library.opcheck(
        torch.ops.flashcore.silu_and_mul_gemv.default, (gate, up, w_out, bias, row, torch.empty(k, device=device))
    )

    def two_layers(hidden):
        for _ in range(2):
            gate, up = layer_ops.gemv(hidden, w_in, norm_weight=norm_weight, eps=1e-5).split(n, dim=-1)
            hidden = layer_ops.silu_and_mul_gemv(gate, up, w_out, bias, residual=hidden)
        return hidden

    torch._dynamo.reset()
    assert torch.equal(torch.compile(two_layers, fullgraph=True)(x), two_layers(x))


@pytest.mark.skipif(not ON_GPU, reason="the direct launch exists on the GPU only (the interpreter runs the JIT)")
def test_gemv_of_a_parameter_takes_the_direct_launch(device, generator):
    """A projection's weight is an ``nn.Parameter``; its GEMV's second launch skips Triton's JIT (host time per eager
    call) through the launch signature the first one left, and gives the same bits."""
    x = randn((1, 1, 96), generator=generator, dtype=torch.float16, device=device)
    weight = torch.nn.Parameter(randn((40, 96), generator=generator, dtype=torch.float16, device=device), False)
    gemv_kernels._launch_gemv._compiled.clear()
    first = layer_ops.gemv(x, weight)
    assert len(gemv_kernels._launch_gemv._compiled) == 1
    assert torch.equal(layer_ops.gemv(x, weight), first)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, head_dim, k", [((4, 2), 64, 100), ((6, 2), 16, 96), ((3, 1), 8, 2500)], ids=["d64", "d16", "d8_k2500"]
)
@pytest.mark.parametrize("fused", [True, False], ids=["q_k_v_fused", "q_alone"])
def test_gemv_folds_the_rotary_embedding(heads, head_dim, k, fused, dtype, device, generator):
    """``gemv(..., cos=, sin=, rotated=)`` gives the bits of the GEMV, then :func:`layer_ops.apply_rotary_embedding`
    (checked against HF's ``apply_rotary_pos_emb`` above) on its q and k rows; the v rows untouched. Fused: the q/k/v
    projection of a decode step, ``rotated`` covering q and k; alone: a q projection, every row rotated."""
    num_q, num_kv = heads
    sizes = [num_q * head_dim, num_kv * head_dim, num_kv * head_dim] if fused else [num_q * head_dim]
    x = randn((1, 1, k), generator=generator, dtype=dtype, device=device)
    weight = randn((sum(sizes), k), generator=generator, dtype=dtype, device=device) / k**0.5
    bias = randn((sum(sizes),), generator=generator, dtype=dtype, device=device)
    angles = randn((1, 1, head_dim // 2), generator=generator, dtype=torch.float32, device=device) * 100
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(dtype) for f in (torch.cos, torch.sin))

    rotated = layer_ops.gemv(x, weight, bias, cos=cos, sin=sin, rotated=sum(sizes[:2]) if fused else None)

    def heads_of(rows):  # [1, 1, H * D] -> [1, H, 1, D], as HF's attention views its projections
        return rows.view(1, 1, -1, head_dim).transpose(1, 2)

    plain = layer_ops.gemv(x, weight, bias).split(sizes, dim=-1)
    query = heads_of(plain[0])
    key = heads_of(plain[1]) if fused else query[:, :1]
    query, key = layer_ops.apply_rotary_embedding(query, key, cos, sin)
    expected = [query] + ([key, heads_of(plain[2])] if fused else [])
    assert torch.equal(rotated, torch.cat([t.transpose(1, 2).reshape(1, 1, -1) for t in expected], dim=-1))


def test_gemv_errors_name_the_argument_and_the_fix(device, generator):
    x = randn((1, 64), generator=generator, dtype=torch.float32, device=device)
    weight = randn((16, 64), generator=generator, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="GEMV takes one row: x must be.*use F.linear"):
        layer_ops.gemv(x.expand(2, 64), weight)
    with pytest.raises(ValueError, match="GEMV takes one row: gate must be"):
        layer_ops.silu_and_mul_gemv(x.expand(2, 64), x.expand(2, 64), weight)
    with pytest.raises(ValueError, match=r"weight must be \[N, K\] with K = gate.shape\[-1\] = 64"):
        layer_ops.silu_and_mul_gemv(x, x, weight[:, :32])
    with pytest.raises(ValueError, match="up must have gate's shape"):
        layer_ops.silu_and_mul_gemv(x, x[:, :32], weight)
    with pytest.raises(ValueError, match=r"residual must have the output's shape \(1, 16\)"):
        layer_ops.gemv(x, weight, residual=x)
    with pytest.raises(TypeError, match="residual dtype torch.float16 must match x"):
        layer_ops.gemv(x, weight, residual=x[:, :16].half())
    with pytest.raises(ValueError, match=r"norm_weight must be \[K\] = \[64\]"):
        layer_ops.gemv(x, weight, norm_weight=x[0, :32])
    with pytest.raises(ValueError, match="eps must be >= 0"):
        layer_ops.gemv(x, weight, norm_weight=x[0], eps=-1.0)
    cos = x[0, :8]
    with pytest.raises(ValueError, match="pass both cos and sin"):
        layer_ops.gemv(x, weight, cos=cos)
    with pytest.raises(ValueError, match=r"cos must be \[..., D\] holding one row"):
        layer_ops.gemv(x, weight, cos=x.expand(2, 64), sin=x.expand(2, 64))
    with pytest.raises(ValueError, match="D is a multiple of 8, got D = 12; apply_rotary_embedding takes any even D"):
        layer_ops.gemv(x, weight[:12], cos=x[0, :12], sin=x[0, :12])
    with pytest.raises(ValueError, match=r"rotated must be a multiple of D = 8 in \(0, N = 16\]"):
        layer_ops.gemv(x, weight, cos=cos, sin=cos, rotated=12)
    with pytest.raises(TypeError, match="sin dtype torch.float16 must match x"):
        layer_ops.gemv(x, weight, cos=cos, sin=cos.half())
    with pytest.raises(ValueError, match=r"weight must be \[N, K\] with K = x.shape\[-1\] = 64"):
        layer_ops.gemv(x, weight[:, :32])
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \[16\]"):
        layer_ops.gemv(x, weight, weight[0])
    with pytest.raises(TypeError, match="weight dtype torch.float16 must match x"):
        layer_ops.gemv(x, weight.half())
    with pytest.raises(ValueError, match="weight must have unit stride"):
        layer_ops.gemv(x, weight.t().contiguous().t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n, k, rows", [(37, 100, 2), (300, 2500, 16), (5, 4500, 7), (70, 256, 1)]
)  # K 2500 and 4500: K cut into slices of tiles (split K), the last tile ragged
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_rows_gemm_matches_fp64_linear(n, k, rows, with_bias, dtype, device, generator):
    """Against ``x @ weight.T + bias`` in fp64, each row. The kernel sums the products in fp32 (in K slices, added in
    K order) and rounds once, so the bound is the GEMV's: half an ulp plus fp32's summation error over K terms. The
    rows are a slice of a wider tensor (a fused projection's output) and the weight a row slice of a wider one."""
    wide_x = randn((rows, 1, k + 9), generator=generator, dtype=dtype, device=device)
    x = wide_x[..., 4 : 4 + k]
    wide = randn((n + 7, k), generator=generator, dtype=dtype, device=device) / k**0.5
    weight = wide[3 : 3 + n]
    bias = randn((n,), generator=generator, dtype=dtype, device=device) if with_bias else None

    out = layer_ops.rows_gemm(x, weight, bias)

    assert out.shape == (rows, 1, n) and out.dtype == dtype and out.is_contiguous()
    x64, weight64 = x.reshape(rows, k).double(), weight.double()
    expected = x64 @ weight64.T + (bias.double() if with_bias else 0)
    bound = torch.finfo(dtype).eps / 2 * expected.abs() + k * torch.finfo(torch.float32).eps * (
        x64.abs() @ weight64.abs().T
    )
    error = (out.reshape(rows, n).double() - expected).abs()
    assert bool((error <= bound).all()), f"worst excess {float((error - bound).max())}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, rows", [(37, 100, 3), (300, 2500, 16)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_rows_gemm_folds_the_swiglu_and_the_residual_add(n, k, rows, with_bias, dtype, device, generator):
    """The SwiGLU input and the residual inside the few-row GEMM give the bits of the separate ops they replace:
    ``silu_and_mul``, then the GEMM; the GEMM, then PyTorch's ``residual + out`` (an fp32 add rounded once). The
    gate and up are the halves of one fused projection's output, as a decode step's are."""
    fused = randn((rows, 1, 2 * k), generator=generator, dtype=dtype, device=device) * 4
    gate, up = fused.split(k, dim=-1)
    weight = randn((n, k), generator=generator, dtype=dtype, device=device) / k**0.5
    bias = randn((n,), generator=generator, dtype=dtype, device=device) if with_bias else None
    residual = randn((rows, 1, n), generator=generator, dtype=dtype, device=device)

    down = layer_ops.rows_gemm(gate, weight, bias, up=up)
    down_added = layer_ops.rows_gemm(gate, weight, bias, up=up, residual=residual)

    separate = layer_ops.rows_gemm(layer_ops.silu_and_mul(gate, up), weight, bias)
    assert torch.equal(down, separate) and torch.equal(down_added, residual + separate)
    assert down_added.shape == (rows, 1, n) and down_added.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, rows", [(200, 256, 16), (192, 4096, 5), (64, 2048, 2)])  # 4096: two K slices
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_rows_gemm_on_tma_matches_fp64_linear(n, k, rows, with_bias, dtype, device, generator):
    """Operands the TMA kernel takes on an sm_90 GPU in fp16/bf16 (``rows_gemm_streams``; elsewhere the Triton
    kernel runs them): against fp64 ``x @ weight.T + bias`` with the bound of
    :func:`test_rows_gemm_matches_fp64_linear`, N past the last whole 64-row block, fewer than 16 rows (the copy fills
    the rest with zeros) and K in two slices. The residual adds as PyTorch's ``residual + out`` does, to the bit."""
    x = randn((rows, k), generator=generator, dtype=dtype, device=device)
    weight = randn((n, k), generator=generator, dtype=dtype, device=device) / k**0.5
    bias = randn((n,), generator=generator, dtype=dtype, device=device) if with_bias else None
    residual = randn((rows, n), generator=generator, dtype=dtype, device=device)
    on_tma = ON_GPU and torch.cuda.get_device_capability()[0] == 9 and dtype != torch.float32
    assert layer_ops.rows_gemm_streams(x, weight) == on_tma

    out = layer_ops.rows_gemm(x, weight, bias)
    added = layer_ops.rows_gemm(x, weight, bias, residual=residual)

    x64, weight64 = x.double(), weight.double()
    expected = x64 @ weight64.T + (bias.double() if with_bias else 0)
    bound = torch.finfo(dtype).eps / 2 * expected.abs() + k * torch.finfo(torch.float32).eps * (
        x64.abs() @ weight64.abs().T
    )
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), f"worst excess {float((error - bound).max())}"
    assert torch.equal(added, residual + out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, rows", [(37, 100, 3), (128, 256, 16), (192, 4096, 7)])  # 4096: two K slices
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_rows_gemm_swiglu_gives_the_gemm_then_silu_and_mul(n, k, rows, with_bias, dtype, device, generator):
    """``rows_gemm(x, [W_gate; W_up], swiglu=True)`` is ``silu_and_mul`` of the plain call's two halves, to the bit,
    whichever kernel runs it (the TMA kernel's epilogue on an sm_90 GPU in fp16/bf16 where K is whole tiles)."""
    x = randn((rows, 1, k), generator=generator, dtype=dtype, device=device) * 2
    weight = randn((2 * n, k), generator=generator, dtype=dtype, device=device) / k**0.5
    bias = randn((2 * n,), generator=generator, dtype=dtype, device=device) if with_bias else None

    activated = layer_ops.rows_gemm(x, weight, bias, swiglu=True)

    gate, up = layer_ops.rows_gemm(x, weight, bias).chunk(2, dim=-1)
    assert activated.shape == (rows, 1, n) and activated.dtype == dtype and activated.is_contiguous()
    assert torch.equal(activated, layer_ops.silu_and_mul(gate, up))


# The shapes whose down projection the one-launch kernel splits into K slices run on the GPU only: on the CPU
# rows_mlp runs the two calls it is compared with, already checked against fp64 on the small shapes, and the
# interpreter takes about 40 s a case at these sizes (CI's time budget).
ONE_LAUNCH_SHAPES = pytest.mark.skipif(
    not ON_GPU, reason="K-sliced one-launch shapes: the CPU runs the two calls, checked on the small shapes"
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hidden, intermediate, rows",
    [
        (256, 512, 3),
        (384, 2048, 16),
        (256, 192, 4),  # I not whole 128-wide tiles: the two launches, on the Triton kernel for the down projection
        pytest.param(1024, 4096, 5, marks=ONE_LAUNCH_SHAPES),  # the down projection in 2 K slices
        pytest.param(2048, 8192, 16, marks=ONE_LAUNCH_SHAPES),  # the Llama-3.2-1B MLP: 4 K slices
    ],
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_rows_mlp_gives_the_two_rows_gemm_calls_bits(hidden, intermediate, rows, with_bias, dtype, device, generator):
    """``rows_mlp`` is ``rows_gemm(x, W_gate_up, swiglu=True)`` then ``rows_gemm(., W_down, residual=r)``, to the
    bit, whether it runs as one launch (``rows_mlp_fuses``: an sm_90 GPU in fp16/bf16) or as those two calls; and
    against the MLP in fp64, within its roundings' bound. The tokens of a patched model: ``test_decode_session.py``."""
    x = randn((rows, 1, hidden), generator=generator, dtype=dtype, device=device)
    gate_up = randn((2 * intermediate, hidden), generator=generator, dtype=dtype, device=device) / hidden**0.5
    down = randn((hidden, intermediate), generator=generator, dtype=dtype, device=device) / intermediate**0.5
    gate_up_bias = randn((2 * intermediate,), generator=generator, dtype=dtype, device=device) if with_bias else None
    down_bias = randn((hidden,), generator=generator, dtype=dtype, device=device) if with_bias else None
    residual = randn((rows, 1, hidden), generator=generator, dtype=dtype, device=device)
    on_tma = ON_GPU and torch.cuda.get_device_capability()[0] == 9 and dtype != torch.float32
    assert layer_ops.rows_mlp_fuses(x, gate_up, down) == (on_tma and intermediate % 128 == 0)

    for _ in range(2):  # the second call finds the counters the first left behind
        out = layer_ops.rows_mlp(x, gate_up, gate_up_bias, down, down_bias, residual=residual)
        plain = layer_ops.rows_mlp(x, gate_up, gate_up_bias, down, down_bias)

        activated = layer_ops.rows_gemm(x, gate_up, gate_up_bias, swiglu=True)
        assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
        assert torch.equal(out, layer_ops.rows_gemm(activated, down, down_bias, residual=residual))
        assert torch.equal(plain, layer_ops.rows_gemm(activated, down, down_bias))

    # And against the MLP in fp64, within what its roundings allow: gate and up each rounded once after an fp32 sum
    # of H products, silu(gate) and its product with up rounded once each (silu's slope is at most 1.1), the down
    # projection an fp32 sum of I products rounded once, then the residual add rounded once.
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    x64, w64, down64, residual64 = x.double(), gate_up.double(), down.double(), residual.double()
    sums = x64 @ w64.T + (gate_up_bias.double() if with_bias else 0)
    sums_error = eps / 2 * sums.abs() + hidden * eps32 * (x64.abs() @ w64.abs().T)
    (gate, up), (gate_error, up_error) = sums.chunk(2, dim=-1), sums_error.chunk(2, dim=-1)
    silu = torch.nn.functional.silu(gate)
    silu_error = 1.1 * gate_error + eps / 2 * silu.abs()
    act = silu * up
    act_error = silu_error * up.abs() + silu.abs() * up_error + silu_error * up_error + eps / 2 * act.abs()
    projected = act @ down64.T + (down_bias.double() if with_bias else 0)
    expected = residual64 + projected
    bound = (
        act_error @ down64.abs().T
        + intermediate * eps32 * (act.abs() @ down64.abs().T)
        + eps / 2 * projected.abs()
        + eps / 2 * expected.abs()
    )
    excess = (out.double() - expected).abs() - bound
    assert bool((excess <= 0).all()), f"worst excess {float(excess.max())}"


def test_rows_mlp_errors_name_the_argument_and_the_fix(device, generator):
    x = randn((4, 64), generator=generator, dtype=torch.float32, device=device)
    gate_up = randn((256, 64), generator=generator, dtype=torch.float32, device=device)
    down = randn((64, 128), generator=generator, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=r"rows_mlp takes 1 to 16 rows: .*got shape \(17, 64\)"):
        layer_ops.rows_mlp(x.repeat(5, 1)[:17], gate_up, None, down)
    with pytest.raises(ValueError, match=r"gate_up_weight must be \[2 I, H\] with H = x.shape\[-1\] = 64"):
        layer_ops.rows_mlp(x, gate_up[:255], None, down)
    with pytest.raises(ValueError, match=r"down_weight must be \[H, I\] = \[64, 128\], got \(128, 64\)"):
        layer_ops.rows_mlp(x, gate_up, None, down.T)
    with pytest.raises(ValueError, match=r"down_bias must be \[64\] or None, got \(128,\)"):
        layer_ops.rows_mlp(x, gate_up, None, down, down[0])
    with pytest.raises(ValueError, match=r"residual must be \[4, 64\] or None"):
        layer_ops.rows_mlp(x, gate_up, None, down, residual=x[:3])
    with pytest.raises(TypeError, match="down_weight dtype torch.float16 must match x"):
        layer_ops.rows_mlp(x, gate_up, None, down.half())
    with pytest.raises(ValueError, match="down_weight must have unit stride"):
        layer_ops.rows_mlp(x, gate_up, None, down.T.contiguous().T)


def test_rows_mlp_op_compiles_to_eager_bits(device, generator):
    """Under ``torch.compile`` the MLP runs as the custom op ``flashcore::rows_mlp``, writing an ``out`` the caller
    allocates: opcheck checks that claim, and a fullgraph compile of two MLPs gives the eager bits."""
    rows, hidden, intermediate = 3, 64, 128
    x = randn((rows, hidden), generator=generator, dtype=torch.float32, device=device)
    gate_up = randn((2 * intermediate, hidden), generator=generator, dtype=torch.float32, device=device) / 8
    down = randn((hidden, intermediate), generator=generator, dtype=torch.float32, device=device) / 11
    bias = randn((hidden,), generator=generator, dtype=torch.float32, device=device)
    out = torch.empty(rows, hidden, device=device)
    op = torch.ops.flashcore.rows_mlp.default
    torch.library.opcheck(op, (x, gate_up, None, down, bias, x, out))

    def two_mlps(hidden_states):
        for _ in range(2):
            hidden_states = layer_ops.rows_mlp(hidden_states, gate_up, None, down, bias, residual=hidden_states)
        return hidden_states

    torch._dynamo.reset()
    assert torch.equal(torch.compile(two_mlps, fullgraph=True)(x), two_mlps(x))


def test_traced_kernel_choices_warn_nothing(device, generator):
    """A compiled step asks which kernel runs a projection (``rows_mlp_fuses``, ``rows_gemm_streams``) in traced
    code, and they ask per-device questions (sm_90 or not, the SM count). torch.compile warns at every
    ``lru_cache``-wrapped function it traces into, so those answers are kept per device in dicts
    (``backends.per_device``): the compiled choice is the eager one, with no such warning. On the CPU the first
    question already says no; on an H100 every one is asked."""
    rows, hidden, intermediate = 3, 128, 256
    x = randn((rows, hidden), generator=generator, dtype=torch.bfloat16, device=device)
    gate_up = randn((2 * intermediate, hidden), generator=generator, dtype=torch.bfloat16, device=device)
    down = randn((hidden, intermediate), generator=generator, dtype=torch.bfloat16, device=device)

    def choices(x):
        fuses, streams = layer_ops.rows_mlp_fuses(x, gate_up, down), layer_ops.rows_gemm_streams(x, gate_up, True)
        return torch.full((1,), 2 * int(fuses) + int(streams), device=x.device)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(choices, fullgraph=True)(x)
    assert torch.equal(compiled, choices(x))
    assert [str(w.message) for w in caught if "lru_cache" in str(w.message)] == []


def test_rows_gemm_op_writes_its_out_and_compiles_to_eager_bits(device, generator):
    """Under ``torch.compile`` the few-row GEMM runs as the custom op ``flashcore::rows_gemm``, which writes into an
    ``out`` the caller allocates, as the GEMVs do; opcheck checks that claim, the fake and functionalization, and a
    fullgraph compile of two MLPs' down projections, each with its residual, gives the eager bits."""
    rows, k, n = 5, 96, 40
    fused = randn((rows, 2 * k), generator=generator, dtype=torch.float32, device=device)
    gate, up = fused.split(k, dim=-1)
    w_down = randn((n, k), generator=generator, dtype=torch.float32, device=device) / k**0.5
    w_up = randn((2 * k, n), generator=generator, dtype=torch.float32, device=device) / n**0.5
    bias = randn((n,), generator=generator, dtype=torch.float32, device=device)
    residual = randn((rows, n), generator=generator, dtype=torch.float32, device=device)
    out = torch.empty(rows, n, device=device)
    op = torch.ops.flashcore.rows_gemm.default
    torch.library.opcheck(op, (gate, up, w_down, bias, residual, None, 0.0, None, None, 0, False, out))
    torch.library.opcheck(op, (gate, None, w_down, None, None, None, 0.0, None, None, 0, False, out))
    w_gate_up = randn((2 * n, 2 * k), generator=generator, dtype=torch.float32, device=device) / k**0.5
    torch.library.opcheck(op, (fused, None, w_gate_up, None, None, None, 0.0, None, None, 0, True, out))

    def two_mlps(hidden):
        for _ in range(2):
            gate, up = (hidden @ w_up.T).split(k, dim=-1)
            hidden = layer_ops.rows_gemm(gate, w_down, bias, up=up, residual=hidden)
        return hidden

    torch._dynamo.reset()
    assert torch.equal(torch.compile(two_mlps, fullgraph=True)(residual), two_mlps(residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n, k, rows", [(64, 100, 3), (300, 2500, 16), (3072, 2048, 16)]
)  # 2500: split K, a ragged last tile; 3072 x 2048: the Llama-3.2-1B q/k/v (the tiles: see the rotary test below)
def test_rows_gemm_folds_the_rms_norm(n, k, rows, dtype, device, generator):
    """``rows_gemm(x, W, norm_weight=w, eps=e)`` against fp64 ``rms_norm(x, w, e) @ W.T`` per row, the norm's output
    taken from :func:`layer_ops.rms_norm` (checked against ``LlamaRMSNorm`` above). As in the GEMV, the kernel sums
    each row's squares in another order, so an input value may round to its neighbour: the bound adds one ulp of
    every input to the GEMM's."""
    x = randn((rows, 1, k), generator=generator, dtype=dtype, device=device) * 3
    norm_weight = 1 + randn((k,), generator=generator, dtype=dtype, device=device) / 4
    weight = randn((n, k), generator=generator, dtype=dtype, device=device) / k**0.5
    bias = randn((n,), generator=generator, dtype=dtype, device=device)

    out = layer_ops.rows_gemm(x, weight, bias, norm_weight=norm_weight, eps=1e-5)

    assert out.shape == (rows, 1, n) and out.dtype == dtype
    normed64 = layer_ops.rms_norm(x, norm_weight, 1e-5).reshape(rows, k).double()
    weight64 = weight.double()
    expected = normed64 @ weight64.T + bias.double()
    magnitude = normed64.abs() @ weight64.abs().T
    eps = torch.finfo(dtype).eps
    bound = eps / 2 * expected.abs() + k * torch.finfo(torch.float32).eps * magnitude + eps * magnitude
    error = (out.reshape(rows, n).double() - expected).abs()
    assert bool((error <= bound).all()), f"worst excess {float((error - bound).max())}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, head_dim, k, rows",
    [((9, 3), 64, 96, 5), ((4, 2), 32, 2500, 16), ((2, 1), 128, 64, 2), ((32, 8), 64, 2048, 16)],
)  # SmolLM2's heads; D 32 (two heads a program); D 128 (half a head a program); K 2500 split; the Llama-3.2-1B q/k/v
# (with the norm on an H100: 2 slices of one 64 x 1024 tile in fp16/bf16, of two 64 x 512 tiles in fp32)
@pytest.mark.parametrize("with_norm", [False, True], ids=["no_norm", "norm"])
def test_rows_gemm_folds_the_rotary_embedding(heads, head_dim, k, rows, with_norm, dtype, device, generator):
    """``rows_gemm(..., cos=, sin=, rotated=)`` gives the bits of the same kernel's GEMM, then
    :func:`layer_ops.apply_rotary_embedding` (checked against HF's ``apply_rotary_pos_emb`` above) on its q and k
    rows, each row at its own position; the v rows untouched: the q/k/v projection of a decode step of ``rows``
    rows, with the layer's norm folded in or not.

    Bit for bit on the GPU. The interpreter runs ``tl.dot`` as numpy's matmul, whose fp32 sums depend on a row's
    place in the tile, and a rotating program holds its weight rows in pair order (at D 32 not the plain one): there
    a product may differ by an ulp before the rotation, so the bound is 4 ulps of the largest output."""
    num_q, num_kv = heads
    sizes = [num_q * head_dim, num_kv * head_dim, num_kv * head_dim]
    x = randn((rows, 1, k), generator=generator, dtype=dtype, device=device)
    weight = randn((sum(sizes), k), generator=generator, dtype=dtype, device=device) / k**0.5
    bias = randn((sum(sizes),), generator=generator, dtype=dtype, device=device)
    norm = dict(norm_weight=1 + randn((k,), generator=generator, dtype=dtype, device=device) / 4, eps=1e-5)
    norm = norm if with_norm else {}
    angles = randn((rows, 1, head_dim // 2), generator=generator, dtype=torch.float32, device=device) * 100
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(dtype) for f in (torch.cos, torch.sin))

    rotated = layer_ops.rows_gemm(x, weight, bias, **norm, cos=cos, sin=sin, rotated=sum(sizes[:2]))

    def heads_of(projected):  # [B, 1, H * D] -> [B, H, 1, D], as HF's attention views its projections
        return projected.view(rows, 1, -1, head_dim).transpose(1, 2)

    # The plain product of the kernel that rotates: on an H100 a bf16/fp16 call without the norm or the rotation runs
    # on the TMA kernel (rows_gemm_streams), whose sums run in another order.
    plain = rows_gemm_kernels.rows_gemm_triton(x.view(rows, k), weight, bias, **norm).view(rows, 1, -1)
    plain = plain.split(sizes, dim=-1)
    query, key = layer_ops.apply_rotary_embedding(heads_of(plain[0]), heads_of(plain[1]), cos, sin)
    expected = torch.cat([t.transpose(1, 2).reshape(rows, 1, -1) for t in (query, key, heads_of(plain[2]))], dim=-1)
    if device.type == "cuda":
        assert torch.equal(rotated, expected)
    else:
        ulp = torch.finfo(dtype).eps * float(expected.abs().max())
        assert float((rotated - expected).abs().max()) <= 4 * ulp


def test_rows_gemm_op_with_the_norm_and_rotary_compiles_to_eager_bits(device, generator):
    """The norm and rotary operands through ``flashcore::rows_gemm``: opcheck, and a fullgraph compile of two
    layers' q/k/v projections, each taking the last one's v rows as its input, gives the eager bits."""
    rows, head_dim, k = 3, 32, 64
    weight = randn((4 * head_dim, k), generator=generator, dtype=torch.float32, device=device) / k**0.5
    norm_weight = 1 + randn((k,), generator=generator, dtype=torch.float32, device=device) / 4
    x = randn((rows, 1, k), generator=generator, dtype=torch.float32, device=device)
    angles = randn((rows, 1, head_dim), generator=generator, dtype=torch.float32, device=device)
    cos, sin = angles.cos(), angles.sin()
    out = torch.empty(rows, 4 * head_dim, device=device)
    args = (x.view(rows, k), None, weight, None, None, norm_weight, 1e-5, cos.view(rows, -1), sin.view(rows, -1), 64)
    torch.library.opcheck(torch.ops.flashcore.rows_gemm.default, (*args, False, out))

    def two_layers(hidden):
        for _ in range(2):
            qkv = layer_ops.rows_gemm(hidden, weight, norm_weight=norm_weight, eps=1e-5, cos=cos, sin=sin, rotated=64)
            hidden = qkv[..., 2 * head_dim :] * 2
        return qkv

    torch._dynamo.reset()
    assert torch.equal(torch.compile(two_layers, fullgraph=True)(x), two_layers(x))


def test_rows_gemm_errors_name_the_argument_and_the_fix(device, generator):
    x = randn((17, 64), generator=generator, dtype=torch.float32, device=device)
    weight = randn((16, 64), generator=generator, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=r"rows_gemm takes 1 to 16 rows: .*got shape \(17, 64\); use F.linear"):
        layer_ops.rows_gemm(x, weight)
    with pytest.raises(ValueError, match="rows_gemm takes swiglu .* alone: not with up"):
        layer_ops.rows_gemm(x[:4], weight, up=x[:4], swiglu=True)
    with pytest.raises(ValueError, match="swiglu needs a weight of gate and up rows, N even, got N = 15"):
        layer_ops.rows_gemm(x[:4], weight[:15], swiglu=True)
    with pytest.raises(ValueError, match=r"up must have x's shape \(4, 64\)"):
        layer_ops.rows_gemm(x[:4], weight, up=x[:3])
    with pytest.raises(TypeError, match="up dtype torch.float16 must match x"):
        layer_ops.rows_gemm(x[:4], weight, up=x[:4].half())
    with pytest.raises(ValueError, match=r"residual must have the output's shape \(4, 16\)"):
        layer_ops.rows_gemm(x[:4], weight, residual=x[:4])
    with pytest.raises(ValueError, match=r"weight must be \[N, K\] with K = x.shape\[-1\] = 64"):
        layer_ops.rows_gemm(x[:4], weight[:, :32])
    with pytest.raises(ValueError, match="x must have unit stride"):
        layer_ops.rows_gemm(x[:4, ::2], weight[:, :32])
    with pytest.raises(ValueError, match="takes up .* or norm_weight, not both"):
        layer_ops.rows_gemm(x[:4], weight, up=x[:4], norm_weight=x[0])
    with pytest.raises(ValueError, match=r"norm_weight must be \[K\] = \[64\]"):
        layer_ops.rows_gemm(x[:4], weight, norm_weight=x[0, :32])
    cos = x[:4, :32]
    with pytest.raises(ValueError, match="pass both cos and sin"):
        layer_ops.rows_gemm(x[:4], weight, cos=cos)
    with pytest.raises(ValueError, match=r"cos must be \[..., D\] holding one row per row of x \(4\)"):
        layer_ops.rows_gemm(x[:4], weight, cos=cos[:2], sin=cos[:2])
    wide = randn((96, 64), generator=generator, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=r"rotated must be a multiple of D = 32 and of 64 in \(0, N = 96\]"):
        layer_ops.rows_gemm(x[:4], wide, cos=cos, sin=cos)
    with pytest.raises(ValueError, match="rotated must be a multiple of D = 32 and of 64"):
        layer_ops.rows_gemm(x[:4], wide, cos=cos, sin=cos, rotated=32)
    assert layer_ops.rows_gemm_can_rotate(64) and not layer_ops.rows_gemm_can_rotate(96)


def test_errors_name_the_argument_and_the_fix(device, generator, monkeypatch):
    x = randn((2, 64), generator=generator, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=r"weight must be \[hidden\] = \[64\]"):
        layer_ops.rms_norm(x, x[0, :32], 1e-5)
    with pytest.raises(TypeError, match="weight dtype torch.float16 must match hidden_states"):
        layer_ops.rms_norm(x, x[0].half(), 1e-5)
    with pytest.raises(ValueError, match="unit stride along its last dim"):
        layer_ops.rms_norm(x.t(), x[:, 0], 1e-5)
    with pytest.raises(ValueError, match=r"residual must have hidden_states' shape \(2, 64\)"):
        layer_ops.add_rms_norm(x, x[:1], x[0], 1e-5)
    with pytest.raises(TypeError, match="residual dtype torch.float16 must match hidden_states"):
        layer_ops.add_rms_norm(x, x.half(), x[0], 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \[hidden\] = \[64\]"):
        layer_ops.add_rms_norm(x, x, x[0, :32], 1e-5)
    with pytest.raises(ValueError, match="up must have gate's shape"):
        layer_ops.silu_and_mul(x, x[:, :10])
    query = randn((1, 4, 3, 6), generator=generator, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="D must be even"):
        layer_ops.apply_rotary_embedding(query[..., :5], query[..., :5], query[0, :1, :, :5], query[0, :1, :, :5])
    cos = randn((1, 3, 6), generator=generator, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=r"cos must be \[B, S, D\]"):
        layer_ops.apply_rotary_embedding(query, query, cos[:, :2], cos[:, :2])
    with pytest.raises(ValueError, match="sin must have cos's shape"):
        layer_ops.apply_rotary_embedding(query, query, cos, cos.transpose(0, 1))
    monkeypatch.setattr(layer_ops, "triton_interpreter_enabled", lambda: False)
    if not ON_GPU:
        with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
            layer_ops.rms_norm(x, x[0], 1e-5)


@pytest.fixture
def layer_kernel_launches(monkeypatch):
    """Counts each layer kernel's launches."""
    counts = {}
    for module, name in (
        (layer_kernels, "rms_norm_triton"),
        (layer_kernels, "add_rms_norm_triton"),
        (layer_kernels, "silu_and_mul_triton"),
        (layer_kernels, "rotary_embedding_triton"),
        (gemv_kernels, "gemv_triton"),
        (rows_gemm_kernels, "rows_gemm_triton"),
    ):
        run = getattr(module, name)

        def counting(*args, _name=name, _run=run, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _run(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    return counts


@pytest.mark.parametrize("fuse_first", [False, True], ids=["kernels_only", "fused_projections_too"])
@torch.no_grad()
def test_patched_model_matches_stock_and_runs_the_kernels(
    fuse_first, device, generator, request, layer_kernel_launches
):
    """fp32, left-padded batch: stock's greedy tokens; every norm, RoPE and SwiGLU of every step on the kernels. The
    decode steps' three rows run the down projection (with the SiLU-and-mul and the residual add) and the LM head
    on the few-row GEMM, and with fused projections the q/k/v projection too (with the input norm and the RoPE): its
    q and k are 128 outputs, two of the kernel's 64-row programs, where the unfused q's 96 are not whole programs.
    The prefill's 21 rows keep the model's GEMMs."""
    model = tiny_llama("gqa", seed_of(request), device)
    input_ids, attention_mask = random_prompts([7, 3, 5], generator, device)
    # Eager steps: a compiled, graph-replayed step (generate's default on CUDA) runs no Python to count.
    kwargs = dict(
        attention_mask=attention_mask, max_new_tokens=5, do_sample=False, pad_token_id=PAD_ID, disable_compile=True
    )
    expected = model.generate(input_ids, **kwargs)
    stock_logits = model(input_ids, attention_mask=attention_mask, use_cache=False).logits

    apply_flashcore_to_llama(model, backend="torch", fuse_projections=fuse_first)
    apply_flashcore_to_llama(model, backend="torch", fuse_projections=fuse_first, layer_kernels=True)
    apply_flashcore_to_llama(model, backend="torch", fuse_projections=fuse_first, layer_kernels=True)  # idempotent
    logits = model(input_ids, attention_mask=attention_mask, use_cache=False).logits
    layer_kernel_launches.clear()
    tokens = model.generate(input_ids, **kwargs)

    assert torch.equal(tokens, expected)
    # Padding rows hold arbitrary logits in both (their attention is masked differently); compare real tokens.
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], stock_logits[real], rtol=1e-4, atol=1e-4)
    layers, forwards = model.config.num_hidden_layers, 5  # a prefill and 4 decode steps
    runs_head_forward = isinstance(model.lm_head.__dict__.get("forward"), integration_layer_kernels.HeadForward)
    qkv_folds = layers * (forwards - 1) if fuse_first else 0  # the decode steps' q/k/v projections
    assert layer_kernel_launches == {
        "add_rms_norm_triton": layers * forwards,  # the add after attention and the norm before the MLP
        "rms_norm_triton": (layers + 1) * forwards - qkv_folds,
        "rotary_embedding_triton": layers * forwards - qkv_folds,
        "silu_and_mul_triton": layers,  # the prefill's
        # each decode step's down projections (and q/k/v), and every forward's LM head where it is flashcore's (on
        # the CPU oneDNN's linears take the head)
        "rows_gemm_triton": layers * (forwards - 1) + qkv_folds + (forwards if runs_head_forward else 0),
    }  # no GEMV: every forward has three rows


@pytest.mark.parametrize("fuse_first", [False, True], ids=["kernels_only", "fused_projections_too"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["llama", "qwen2_biases"])
@torch.no_grad()
def test_batch_1_decode_runs_the_gemv(fuse_first, with_bias, device, generator, request, layer_kernel_launches):
    """At one row per step every projection of a decode step runs on the GEMV, with the norms, the RoPE, the residual
    adds and the SiLU-and-mul inside (stock's tokens and logits); the prefill, with more rows, keeps the model's
    GEMMs but for the down projection, on the few-row GEMM at its 6 rows."""
    seed = seed_of(request)
    model = tiny_same_attention_model("qwen2", seed, device) if with_bias else tiny_llama("gqa", seed, device)
    input_ids, attention_mask = random_prompts([6], generator, device)
    kwargs = dict(
        attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID, disable_compile=True
    )
    expected = model.generate(input_ids, **kwargs)
    stock_logits = model(expected[:, -1:], use_cache=False).logits

    # oneDNN off: on the CPU it would take the LM head's forward, which the GEMV then leaves alone.
    apply_flashcore_to_llama(
        model, backend="torch", fuse_projections=fuse_first, layer_kernels=True, onednn_linears=False
    )
    layer_kernel_launches.clear()
    tokens = model.generate(input_ids, **kwargs)
    launches = dict(layer_kernel_launches)
    logits = model(expected[:, -1:], use_cache=False).logits

    assert torch.equal(tokens, expected)
    projections = 4 if fuse_first else 7  # q/k/v, o, gate/up, down; or each of the seven
    decode_steps = 3  # the 4 new tokens: the prefill's, then 3 one-row decode steps
    layers = model.config.num_hidden_layers
    # A decode step's RMSNorms (but the final one), RoPE and SiLU-and-mul run inside the GEMVs; the prefill's norms
    # and RoPE on their own, its 6 rows' SiLU-and-mul and residual add inside the few-row GEMM of the down projection.
    # Fused, the prefill's q/k/v projection runs on the few-row GEMM too, with its norm and RoPE (q and k are 128
    # outputs, two of its 64-row programs).
    assert model.config.head_dim % 8 == 0  # what the GEMV's RoPE takes
    prefill_qkv = layers if fuse_first else 0
    expected_launches = {
        "gemv_triton": decode_steps * layers * projections + 1 + decode_steps,  # and the LM head's, of the last token
        "add_rms_norm_triton": layers,
        "rms_norm_triton": layers + 1 + decode_steps - prefill_qkv,
        "rotary_embedding_triton": layers - prefill_qkv,
        "rows_gemm_triton": layers + prefill_qkv,
    }
    assert launches == {name: count for name, count in expected_launches.items() if count}
    torch.testing.assert_close(logits, stock_logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_remove_restores_the_model_forwards(device, generator, request):
    model = tiny_llama("mha", seed_of(request), device)
    input_ids, attention_mask = random_prompts([6, 4], generator, device)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID)
    expected = model.generate(input_ids, **kwargs)
    apply_flashcore_to_llama(model, backend="torch", layer_kernels=True)
    # HF's automatic compile must round the residual adds as eager does (inductor fuses them otherwise).
    assert model.generation_config.compile_config.options["emulate_precision_casts"] is True
    apply_flashcore_to_llama(model, backend="torch", fuse_projections=True)  # layer kernels off, projections fused
    assert model.generation_config.compile_config is None
    for layer in model.model.layers:
        assert "_fused_projection" in layer.self_attn.__dict__ and "forward" in layer.self_attn.__dict__
        assert "forward" not in layer.input_layernorm.__dict__
        assert "_uses_layer_kernels" not in layer.mlp.__dict__
    remove_flashcore(apply_flashcore_to_llama(model, backend="torch", layer_kernels=True))

    for module in model.modules():
        assert "forward" not in module.__dict__ and "_uses_layer_kernels" not in module.__dict__
    assert model.generation_config.compile_config is None
    assert torch.equal(model.generate(input_ids, **kwargs), expected)


def test_layer_kernels_refuse_what_they_cannot_run(device, request):
    """Refused up front: neither an unpatched model nor a patched one is changed by the refused call."""
    model = tiny_llama("gqa", seed_of(request), device)
    model.config.hidden_act = "gelu"
    with pytest.raises(NotImplementedError, match="hidden_act"):
        apply_flashcore_to_llama(model, backend="torch", layer_kernels=True)
    assert "_flashcore_state" not in model.__dict__ and model.config._attn_implementation == "sdpa"
    apply_flashcore_to_llama(model, backend="torch", fuse_projections=True)
    with pytest.raises(NotImplementedError, match="hidden_act"):
        apply_flashcore_to_llama(model, backend="triton", layer_kernels=True)
    assert model._flashcore_state.backend == "torch" and "_fused_projection" in model.model.layers[0].mlp.__dict__
    remove_flashcore(model)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and inductor's GPU kernels: the rounding gap is a GPU matter")
@torch.no_grad()
def test_bf16_tokens_equal_eagerly_replayed_and_compiled(device, generator, request):
    """Issue 5's "tokens identical to eager flashcore" for the compiled paths. Without the layer kernels inductor
    fuses the norms and SwiGLU its own way and a bf16 model parts from eager tokens within a few dozen steps
    (NOTES.md, entry 8). With them, eager generate, the graph-replayed session, the compiled session and HF's
    automatic compile of generate must all pick the same tokens."""
    model = bf16_llama(
        seed_of(request), device, vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, initializer_range=0.05,
    )  # fmt: skip
    config = model.config
    apply_flashcore_to_llama(model, backend="triton", fuse_projections=True, layer_kernels=True)
    input_ids, attention_mask = random_prompts([40, 25, 40, 33], generator, device)
    max_cache_len, new_tokens = 512, 64

    def generate(disable_compile):
        cache = FlashCoreCache(config, max_cache_len, max_batch_size=4, device=device, dtype=torch.bfloat16)
        out = model.generate(
            input_ids, attention_mask=attention_mask, **{CACHE_ARGUMENT_NAME: cache}, max_new_tokens=new_tokens,
            do_sample=False, disable_compile=disable_compile,
        )  # fmt: skip
        return out[:, input_ids.shape[1] :]

    def session_tokens(compile):
        session = DecodeSession(model, max_cache_len=max_cache_len, batch_size=4, compile=compile)
        tokens = [session.prefill(input_ids, attention_mask).clone()]
        tokens += [session.decode_step().clone() for _ in range(new_tokens - 1)]
        return torch.stack(tokens, dim=1)

    eager = generate(disable_compile=True)
    assert torch.equal(session_tokens(compile=False), eager)
    assert torch.equal(session_tokens(compile=True), eager)
    torch._dynamo.reset()
    for _ in range(2):  # the first call compiles, the second replays HF's CUDA graphs
        assert torch.equal(generate(disable_compile=False), eager)


def test_layer_kernels_keep_a_compile_config_the_user_set(device, request):
    from transformers import CompileConfig

    model = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), device), backend="torch")
    mine = CompileConfig(mode="max-autotune")
    model.generation_config.compile_config = mine
    remove_flashcore(apply_flashcore_to_llama(model, backend="torch", layer_kernels=True))
    assert model.generation_config.compile_config is mine
