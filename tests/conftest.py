"""Shared test setup: where the suite runs, the Triton interpreter switch, per-test seeds and tolerances.

``FLASHCORE_TEST_DEVICE=cuda`` moves the whole suite onto the GPU (triton compiled for real, bf16 included).
Unset or ``cpu``, the Triton kernels run on the CPU through ``TRITON_INTERPRET=1``, which must be set before
triton is first imported; that is why it is set here, at collection time.
"""

from __future__ import annotations

import os
import zlib

import pytest

TEST_DEVICE = os.environ.get("FLASHCORE_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402  (after the interpreter switch)

ON_GPU = TEST_DEVICE == "cuda"
if ON_GPU and not torch.cuda.is_available():
    raise RuntimeError("FLASHCORE_TEST_DEVICE=cuda but torch sees no CUDA device")

# The interpreter gives garbage for a bf16 tl.dot (seen with triton 3.9), so bf16 runs on the GPU only.
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]

# Max-abs-error bounds against the fp64 oracle, for N(0, 1) inputs and softmax outputs bounded by max|V|.
TOLERANCES = {
    # fp32 math, but the GPU's tl.dot on fp32 may round operands to tf32 (10-bit mantissa): ~1e-3 relative.
    torch.float32: 2e-3 if ON_GPU else 1e-4,
    # fp16 inputs are exact; P is rounded to fp16 before P @ V and the output is stored in fp16 (eps 2^-11).
    torch.float16: 1e-2,
    # bf16 has an 8-bit mantissa (eps 2^-8): output rounding alone is ~4e-3 on values of size ~1.
    torch.bfloat16: 3e-2,
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "torch_kernel(name): the torch backend's kernel this case runs (see the torch_kernel fixture)"
    )


@pytest.fixture
def device() -> torch.device:
    # Indexed ("cuda:0"), as tensor.device always is, so that device equality checks compare like with like.
    return torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")


@pytest.fixture
def generator(request) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per case, reproducible per case."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(shape, *, generator: torch.Generator, dtype: torch.dtype, device) -> torch.Tensor:
    """N(0, 1) data drawn on the CPU (so the draw does not depend on the device), then moved."""
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype=dtype, device=device)


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Fills a tensor with NaN in place: a slot that should never be read, or never left unwritten."""
    return tensor.fill_(float("nan"))


def record_kernel_runs(monkeypatch, record) -> None:
    """Wraps the ``run`` of every kernel in ``flashcore.kernels.ATTENTION_KERNELS`` so that each call first hands
    ``(backend, kernel, call)`` to ``record``; the real kernel still runs. Every eager path to a kernel (the op, an
    ``ops.AttentionPlan``) and a compiled graph's first trace end in its ``run``; CUDA-graph replays run no Python."""
    import flashcore.kernels

    for backend, row in flashcore.kernels.ATTENTION_KERNELS.items():
        for kernel in row:

            def recording_run(call, kernel=kernel, backend=backend, run=kernel.run, **options):
                record(backend, kernel, call)
                return run(call, **options)  # options: out=, for a kernel that TAKES_OUT

            monkeypatch.setattr(kernel, "run", recording_run)


@pytest.fixture
def kernels_run(monkeypatch) -> list[str]:
    """The ``NAME`` of every attention kernel that runs, in call order (:func:`record_kernel_runs`)."""
    names: list[str] = []
    record_kernel_runs(monkeypatch, lambda backend, kernel, call: names.append(kernel.NAME))
    return names


@pytest.fixture(autouse=True)
def torch_kernel(request, monkeypatch) -> str | None:
    """For a case marked ``torch_kernel(NAME)`` (``cases.BACKENDS``), the torch kernel it must run, else None.

    The torch backend's row holds two kernels: ``torch.sdpa`` takes every call it can (on the CPU, all of them) and
    ``torch.reference`` the rest, so without help the reference would go untested. A case marked with the reference
    gets a row of the reference alone; either way every torch call of the case is checked, after the test, to have
    run the named kernel."""
    marker = request.node.get_closest_marker("torch_kernel")
    if marker is None:
        yield None
        return
    import flashcore.kernels

    name = marker.args[0]
    row = flashcore.kernels.ATTENTION_KERNELS["torch"]
    if name != row[0].NAME:
        monkeypatch.setitem(flashcore.kernels.ATTENTION_KERNELS, "torch", tuple(k for k in row if k.NAME == name))
    torch_kernels_run: list[str] = []

    def record(backend, kernel, call):
        if backend == "torch":
            torch_kernels_run.append(kernel.NAME)

    record_kernel_runs(monkeypatch, record)
    yield name
    assert torch_kernels_run and set(torch_kernels_run) == {name}, f"expected {name} to run, got {torch_kernels_run}"
