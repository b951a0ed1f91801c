"""Where a call runs: the backend names, the dtypes every backend takes, and the two questions of the execution
context that decide what a call may do (is the Triton interpreter on; is a CUDA graph being captured or
``torch.compile`` tracing).

Every layer asks these here, so the answers (and their error messages) are the same in ops, the layer ops and the
HF integration.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys

import torch

BACKENDS = ("auto", "triton", "torch")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_interpreter_at_import: bool | None = None  # TRITON_INTERPRET as triton read it, once triton is imported


def triton_interpreter_enabled() -> bool:
    """Whether Triton runs kernels on the CPU (``TRITON_INTERPRET=1``, which must be set before triton is imported).

    Read from the environment until triton is imported, and fixed from then on, as it is for triton: every CPU call
    asks this (``"auto"`` picks its backend by it), and the environment lookup was part of a decode step's host time.
    """
    global _interpreter_at_import
    if _interpreter_at_import is not None:
        return _interpreter_at_import
    enabled = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if "triton" in sys.modules:
        _interpreter_at_import = enabled
    return enabled


def on_device_of(tensor: torch.Tensor):
    """A context in which ``tensor``'s GPU is the current device. Triton launches a kernel on the current device's
    stream, whatever device its pointers are on: under ``device_map`` a layer on the second GPU would otherwise run
    on the first one and read the wrong memory. A no-op for a CPU tensor or one already on the current device."""
    index = tensor.get_device()
    if index < 0 or index == torch.cuda.current_device():
        return _STAY
    return torch.cuda.device(index)


_STAY = contextlib.nullcontext()  # reusable: one object for every call that stays where it is


def per_device(query):
    """``query(device)`` asked once per device, the answers kept in a dict. ``functools.cache`` would do eagerly, but
    the layer ops ask these in a compiled step's traced code too, and torch.compile warns at every
    ``lru_cache``-wrapped function it traces into."""
    answers = {}

    @functools.wraps(query)
    def cached(device: torch.device):
        answer = answers.get(device)
        if answer is None:
            answer = answers[device] = query(device)
        return answer

    return cached


_as_captured = False  # set by kernels_as_captured(); one flag per process, as flashcore runs one stream per device


@contextlib.contextmanager
def kernels_as_captured():
    """Eager calls in this context launch the kernel variants a CUDA-graph capture would (the split merge in a launch
    of its own, :func:`flashcore.kernels.triton.split_merge.merges_in_attention_launch`). A step warmed up eagerly
    before its capture runs in it, so that the warm-up compiles what the capture replays, and the capture compiles
    nothing (``DecodeSession``, the engine's decode buckets; benchmarks/NOTES.md, entry 46)."""
    global _as_captured
    outer, _as_captured = _as_captured, True
    try:
        yield
    finally:
        _as_captured = outer


@contextlib.contextmanager
def cycle_collector_paused():
    """Pauses Python's cycle collector through a CUDA-graph capture.

    A dropped owner of CUDA graphs that is a reference cycle (a ``DecodeSession`` holds its own bound step method)
    keeps its graphs until the collector runs. Run in the middle of another capture (an allocation can trigger it),
    the graphs' teardown invalidates that capture ("operation not permitted when stream is capturing"). A full
    collection before each capture prevents it too, at host time that grows with the process's objects; paused, the
    collector frees them after the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def captured_graph(pool=None):
    """Captures the block's CUDA work into the graph it yields (``torch.cuda.graph``, which drains the device first,
    with the memory ``pool`` if given), the cycle collector paused through it (:func:`cycle_collector_paused`). The
    one way flashcore captures: a ``DecodeSession``'s step and prefill, a compiled step, the engine's batch buckets."""
    graph = torch.cuda.CUDAGraph()
    with cycle_collector_paused(), torch.cuda.graph(graph, pool=pool):
        yield graph


def picks_captured_kernels(device: torch.device) -> bool:
    """Whether a launch on ``device`` takes its CUDA-graph variant: while a graph is captured, or in
    :func:`kernels_as_captured`."""
    return device.type == "cuda" and (_as_captured or torch.cuda.is_current_stream_capturing())


def is_capturing_or_tracing() -> bool:
    """Whether host reads are forbidden now: ``torch.compile`` is tracing, or a CUDA graph is being captured."""
    if torch.compiler.is_compiling():
        return True
    return _cuda_is_available() and torch.cuda.is_current_stream_capturing()


@functools.cache
def _cuda_is_available() -> bool:
    # Asked once: torch.cuda.is_available() reads an environment variable and queries the runtime on every call,
    # and the HF integration asks this once per layer of every eager decode step (NOTES.md, entry 40).
    return torch.cuda.is_available()


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """``"auto"`` → ``"triton"`` on CUDA or under the interpreter, ``"torch"`` otherwise; a named backend is checked
    against the tensor's device and returned. Nothing ever falls back from one backend to the other."""
    if backend == "torch":  # runs anywhere
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    runs_triton = tensor.is_cuda or triton_interpreter_enabled()
    if backend == "auto":
        return "triton" if runs_triton else "torch"
    if backend == "triton" and not runs_triton:
        raise NotImplementedError(
            f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to run "
            f"the kernels on the CPU; got tensors on {tensor.device}. Use backend='torch' (or 'auto') on the CPU."
        )
    return backend
