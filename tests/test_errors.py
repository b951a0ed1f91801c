"""Bad input to ``attention_with_kv_cache``: one test per class, each naming the argument, and none writing.

Every failing call is followed by a bitwise comparison of K, V and ``seq_lens`` with clones taken before it
(the caches here hold no NaN, so ``torch.equal`` is exact). Positive controls sit at the edge: a row that
ends exactly at capacity, and ``query_lens`` equal to ``S_q``, must not raise.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, TOLERANCES, randn
from oracle import attention_oracle

import flashcore
import flashcore.backends
import flashcore.ops

BACKENDS = ["torch", "triton"]
BATCH, NUM_Q_HEADS, NUM_KV_HEADS, NUM_NEW, HEAD_DIM, CAPACITY = 2, 4, 2, 3, 16, 8


def _inputs(generator, device, *, dtype=None, seq_lens=(2, 5)):
    """q, k, v and a fully random (NaN-free) cache whose rows hold ``seq_lens`` tokens."""
    dtype = dtype or DTYPES[0]

    def draw(*shape):
        return randn(shape, generator=generator, dtype=dtype, device=device)

    query = draw(BATCH, NUM_Q_HEADS, NUM_NEW, HEAD_DIM)
    key, value = draw(BATCH, NUM_KV_HEADS, NUM_NEW, HEAD_DIM), draw(BATCH, NUM_KV_HEADS, NUM_NEW, HEAD_DIM)
    cache = (
        draw(BATCH, NUM_KV_HEADS, CAPACITY, HEAD_DIM),
        draw(BATCH, NUM_KV_HEADS, CAPACITY, HEAD_DIM),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
    return query, key, value, cache


def _raises_and_writes_nothing(error, match, query, key, value, cache, **kwargs):
    """Calls with ``cache``, expects ``error`` matching ``match``, then checks the cache is unchanged."""
    before = [t.clone() for t in cache]
    with pytest.raises(error, match=match):
        flashcore.attention_with_kv_cache(query, key, value, cache, **kwargs)
    for name, tensor, clone in zip(("k_cache", "v_cache", "seq_lens"), cache, before, strict=True):
        assert tensor.dtype == clone.dtype and torch.equal(tensor, clone), f"a failed call changed {name}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_names_row_and_sizes(backend, device, generator):
    query, key, value, cache = _inputs(generator, device, seq_lens=(CAPACITY - NUM_NEW, CAPACITY - NUM_NEW + 1))
    match = rf"row 1: seq_lens\[1\] = {CAPACITY - NUM_NEW + 1} cached \+ {NUM_NEW} new .* S_max = {CAPACITY}"
    _raises_and_writes_nothing(ValueError, match, query, key, value, cache, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_counts_only_valid_new_tokens(backend, device, generator):
    """query_lens, not S_q, decides the overflow: row 0 fits with 1 token, but not with 2."""
    query, key, value, cache = _inputs(generator, device, seq_lens=(CAPACITY - 1, 0))
    query_lens = torch.tensor([2, NUM_NEW], dtype=torch.int32, device=device)
    match = r"row 0: seq_lens\[0\]"
    _raises_and_writes_nothing(ValueError, match, query, key, value, cache, query_lens=query_lens, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_query_lens", [False, True])
def test_exact_capacity_does_not_raise(backend, use_query_lens, device, generator):
    """Positive control: both rows end exactly at S_max after the call."""
    query_lens = torch.tensor([NUM_NEW, 1], dtype=torch.int32, device=device) if use_query_lens else None
    last_new = 1 if use_query_lens else NUM_NEW
    seq_lens = [CAPACITY - NUM_NEW, CAPACITY - last_new]
    query, key, value, cache = _inputs(generator, device, seq_lens=seq_lens)
    k_before, v_before = cache[0].clone(), cache[1].clone()
    out, returned = flashcore.attention_with_kv_cache(query, key, value, cache, query_lens=query_lens, backend=backend)
    assert returned[2].tolist() == [CAPACITY, CAPACITY]
    assert torch.equal(cache[0][1, :, CAPACITY - last_new :], key[1, :, :last_new])
    assert torch.equal(cache[1][1, :, CAPACITY - last_new :], value[1, :, :last_new])
    new_lens = [NUM_NEW, last_new]
    keys = [torch.cat([k_before[b, :, :n], key[b, :, : new_lens[b]]], dim=1) for b, n in enumerate(seq_lens)]
    values = [torch.cat([v_before[b, :, :n], value[b, :, : new_lens[b]]], dim=1) for b, n in enumerate(seq_lens)]
    expected = attention_oracle(query, keys, values, seq_lens, new_lens, is_causal=True)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCES[DTYPES[0]], rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["seq_lens", "query_lens"])
def test_lengths_must_be_int32(backend, name, device, generator):
    """No silent conversion: an int64 seq_lens converted to a copy would lose the in-place update."""
    query, key, value, cache = _inputs(generator, device)
    query_lens = torch.full((BATCH,), NUM_NEW, dtype=torch.int32, device=device)
    if name == "seq_lens":
        cache = (cache[0], cache[1], cache[2].long())
    else:
        query_lens = query_lens.long()
    _raises_and_writes_nothing(
        TypeError, rf"{name} must be torch.int32", query, key, value, cache, query_lens=query_lens, backend=backend
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["seq_lens", "query_lens"])
def test_lengths_must_be_contiguous(backend, name, device, generator):
    """A strided seq_lens can't be copied to contiguous silently: the copy would take the in-place update."""
    query, key, value, cache = _inputs(generator, device)
    query_lens = torch.full((BATCH,), NUM_NEW, dtype=torch.int32, device=device)
    every_other = torch.stack([cache[2], cache[2]], dim=1)[:, 0] if name == "seq_lens" else None
    if name == "seq_lens":
        cache = (cache[0], cache[1], every_other)
    else:
        query_lens = torch.stack([query_lens, query_lens], dim=1)[:, 0]
    _raises_and_writes_nothing(
        ValueError, rf"{name} must be contiguous", query, key, value, cache, query_lens=query_lens, backend=backend
    )


SHAPE_ERRORS = {
    "query_heads_not_multiple": r"query heads \(3\) must be a multiple of key/value heads \(2\)",
    "cache_heads": r"k_cache/v_cache .* H_kv=2",
    "key_head_dim": r"key/value must be \[B, H_kv, S_q, D\]",
    "cache_head_dim": r"k_cache/v_cache .* D=16",
    "key_batch": r"key/value must be \[B, H_kv, S_q, D\]",
    "cache_batch": r"k_cache/v_cache .*\[B=2",
    "seq_lens_batch": r"seq_lens must have shape \[B\]",
    "query_lens_batch": r"query_lens must have shape \[B\]",
    "key_value_shapes": r"key and value must have the same shape",
    "k_v_cache_shapes": r"k_cache and v_cache must both be",
    "query_3d": r"query must be 4-D",
    "head_dim_too_big": r"head_dim",
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", list(SHAPE_ERRORS))
def test_mismatched_shapes(backend, bad, device, generator):
    query, key, value, cache = _inputs(generator, device)
    k_cache, v_cache, seq_lens = cache
    query_lens = None
    if bad == "query_heads_not_multiple":
        query = query[:, :3]
    elif bad == "cache_heads":
        k_cache, v_cache = k_cache[:, :1], v_cache[:, :1]
    elif bad == "key_head_dim":
        key, value = key[..., :8], value[..., :8]
    elif bad == "cache_head_dim":
        k_cache, v_cache = k_cache[..., :8], v_cache[..., :8]
    elif bad == "key_batch":
        key, value = key[:1], value[:1]
    elif bad == "cache_batch":
        k_cache, v_cache = k_cache[:1], v_cache[:1]
    elif bad == "seq_lens_batch":
        seq_lens = seq_lens[:1]
    elif bad == "query_lens_batch":
        query_lens = torch.ones(BATCH + 1, dtype=torch.int32, device=device)
    elif bad == "key_value_shapes":
        value = value[:, :, :2]
    elif bad == "k_v_cache_shapes":
        v_cache = v_cache[:, :, :4]
    elif bad == "query_3d":
        query = query[0]
    else:
        big = flashcore.ops.MAX_HEAD_DIM + 1
        query, key, value = (t.new_ones(*t.shape[:3], big) for t in (query, key, value))
        k_cache, v_cache = (t.new_ones(*t.shape[:3], big) for t in (k_cache, v_cache))
    cache = (k_cache, v_cache, seq_lens)
    _raises_and_writes_nothing(
        ValueError, SHAPE_ERRORS[bad], query, key, value, cache, query_lens=query_lens, backend=backend
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["key", "value", "k_cache", "v_cache"])
def test_mismatched_dtype(backend, name, device, generator):
    query, key, value, (k_cache, v_cache, seq_lens) = _inputs(generator, device, dtype=torch.float32)
    tensors = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache}
    tensors[name] = tensors[name].half()
    cache = (tensors["k_cache"], tensors["v_cache"], seq_lens)
    _raises_and_writes_nothing(
        TypeError,
        rf"{name} dtype torch.float16 must match query dtype",
        query,
        tensors["key"],
        tensors["value"],
        cache,
        backend=backend,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsupported_dtype(backend, device, generator):
    query, key, value, cache = _inputs(generator, device, dtype=torch.float64)
    _raises_and_writes_nothing(TypeError, r"query dtype must be one of", query, key, value, cache, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["key", "value", "k_cache", "v_cache", "seq_lens", "query_lens"])
def test_mismatched_device(backend, name, device, generator):
    """The other device is "meta" on the CPU (no data, so nothing can be written to it) and the CPU on CUDA."""
    other = torch.device("cpu") if device.type == "cuda" else torch.device("meta")
    query, key, value, (k_cache, v_cache, seq_lens) = _inputs(generator, device)
    tensors = {
        "key": key,
        "value": value,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "seq_lens": seq_lens,
        "query_lens": torch.ones(BATCH, dtype=torch.int32, device=device),
    }
    tensors[name] = tensors[name].to(other)
    cache = (tensors["k_cache"], tensors["v_cache"], tensors["seq_lens"])
    # The clone check compares on the tensors' own devices; a meta tensor's only state is its metadata.
    before = [t.clone() for t in cache]
    with pytest.raises(ValueError, match=rf"{name} is on {other}"):
        flashcore.attention_with_kv_cache(
            query, tensors["key"], tensors["value"], cache, query_lens=tensors["query_lens"], backend=backend
        )
    for tensor, clone in zip(cache, before, strict=True):
        assert tensor.is_meta or torch.equal(tensor, clone)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("query_len", [NUM_NEW + 1, -1])
def test_query_lens_out_of_range(backend, query_len, device, generator):
    query, key, value, cache = _inputs(generator, device)
    query_lens = torch.tensor([NUM_NEW, query_len], dtype=torch.int32, device=device)
    _raises_and_writes_nothing(
        ValueError,
        rf"query_lens\[1\] = {query_len} must be in \[0, S_q={NUM_NEW}\]",
        query,
        key,
        value,
        cache,
        query_lens=query_lens,
        backend=backend,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_seq_lens(backend, device, generator):
    query, key, value, cache = _inputs(generator, device, seq_lens=(3, -1))
    _raises_and_writes_nothing(ValueError, r"seq_lens\[1\] = -1 is negative", query, key, value, cache, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scale": 0.0}, "scale"),
        ({"scale": float("nan")}, "scale"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": 2.5}, "sliding_window"),
    ],
)
def test_bad_scalars(backend, kwargs, match, device, generator):
    query, key, value, cache = _inputs(generator, device)
    _raises_and_writes_nothing(ValueError, match, query, key, value, cache, backend=backend, **kwargs)


def test_unknown_backend(device, generator):
    query, key, value, cache = _inputs(generator, device)
    _raises_and_writes_nothing(ValueError, r"backend must be one of", query, key, value, cache, backend="cuda")


def test_triton_on_cpu_without_interpreter(monkeypatch, generator):
    """CPU tensors and no TRITON_INTERPRET=1: an explicit error, never a silent run on the torch backend."""
    monkeypatch.setattr(flashcore.backends, "triton_interpreter_enabled", lambda: False)
    query, key, value, cache = _inputs(generator, torch.device("cpu"))
    _raises_and_writes_nothing(
        NotImplementedError, r"backend='triton' needs CUDA tensors", query, key, value, cache, backend="triton"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_max_len_with_a_cache(backend, device, generator):
    query, key, value, cache = _inputs(generator, device)
    _raises_and_writes_nothing(
        ValueError, "cache_max_len", query, key, value, cache, cache_max_len=CAPACITY, backend=backend
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_cache_and_no_cache_max_len(backend, device, generator):
    query, key, value, _ = _inputs(generator, device)
    with pytest.raises(ValueError, match="cache_max_len"):
        flashcore.attention_with_kv_cache(query, key, value, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_max_len_too_short(backend, device, generator):
    query, key, value, _ = _inputs(generator, device)
    with pytest.raises(ValueError, match=rf"overflow in row 0: .* S_max = {NUM_NEW - 1}"):
        flashcore.attention_with_kv_cache(query, key, value, cache_max_len=NUM_NEW - 1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seq_len", [CAPACITY - 1, -2])
def test_unchecked_call_never_writes_out_of_bounds(backend, seq_len, device, generator):
    """check=False skips the value checks (for graph capture), but the kernel still stays inside the cache:
    the cache is a view into a buffer with guard rows on both sides, which must keep their 7s."""
    dtype = DTYPES[0]
    query, key, value, _ = _inputs(generator, device, dtype=dtype)
    guard = 4
    buffers = [
        torch.full((BATCH, NUM_KV_HEADS, guard + CAPACITY + guard, HEAD_DIM), 7.0, dtype=dtype, device=device)
        for _ in range(2)
    ]
    k_cache, v_cache = (buffer[:, :, guard : guard + CAPACITY] for buffer in buffers)
    seq_lens = torch.tensor([seq_len, 0], dtype=torch.int32, device=device)
    out, _ = flashcore.attention_with_kv_cache(
        query, key, value, (k_cache, v_cache, seq_lens), check=False, backend=backend
    )
    for buffer in buffers:
        assert (buffer[:, :, :guard] == 7).all() and (buffer[:, :, guard + CAPACITY :] == 7).all()
    # Row 1 is a valid row and must come out right whatever its neighbour does.
    assert torch.equal(k_cache[1, :, :NUM_NEW], key[1]) and torch.equal(v_cache[1, :, :NUM_NEW], value[1])
    expected = attention_oracle(query[1:], [key[1]], [value[1]], [0], [NUM_NEW], is_causal=True)
    torch.testing.assert_close(out[1:].double(), expected, atol=TOLERANCES[dtype], rtol=0)
