"""Fixtures of the HF integration's tests: a tiny model per attention layout, and a record of the attention calls.

A test module loads them with ``pytest_plugins = ["hf_fixtures"]``; the suite-wide fixtures stay in conftest.py.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from conftest import record_kernel_runs
from hf_models import seed_of, tiny_llama

from flashcore.integrations.llama import remove_flashcore


@pytest.fixture(params=["gqa", "mha"])
def model(request, device):
    model = tiny_llama(request.param, seed_of(request), device)
    # On CUDA, generate compiles the decode step into CUDA graphs, whose replays bypass the Python-level launch
    # counters these tests read; the compiled path has its own test (test_auto_compile_matches_eager_on_gpu).
    model.generation_config.disable_compile = True
    yield model
    remove_flashcore(model)


class Launch(NamedTuple):
    """One attention call as ops dispatched it."""

    backend: str  # "torch" or "triton"
    s_q: int
    kernel: str  # the kernel module's NAME
    query_lens: torch.Tensor | None  # a copy, taken at the call


@pytest.fixture
def launches(monkeypatch) -> list[Launch]:
    """Every attention call while the test runs, in order (conftest's ``record_kernel_runs``: eager calls, and a
    compiled graph's first trace, not CUDA-graph replays)."""
    seen = []

    def record(backend, kernel, call):
        query_lens = None if call.query_lens is None else call.query_lens.clone()  # no host read during a capture
        seen.append(Launch(backend, call.query.shape[2], kernel.NAME, query_lens))

    record_kernel_runs(monkeypatch, record)
    return seen
