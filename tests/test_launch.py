"""``CachedLauncher``: after the first launch of a signature it calls the compiled kernel directly, so its
signature must separate every call that Triton's JIT would compile differently."""

from __future__ import annotations

import pytest
import torch
import triton
from conftest import TOLERANCES, randn
from oracle import check_call, make_call_inputs

import flashcore
from flashcore.kernels.launch import CachedLauncher, TensorDescriptor, _launch_hooks_set, uses_programmatic_launch
from flashcore.kernels.triton import attention as triton_attention
from flashcore.kernels.triton.attention import _attention_with_kv_cache_kernel


def test_signature_separates_what_triton_specialises_on():
    launcher = CachedLauncher(_attention_with_kv_cache_kernel)
    aligned = torch.zeros(64, dtype=torch.float16)

    def signature(tensor, integer, scale, grid=(1, 1, 1), block=16, device=0, **options):
        options = dict(num_warps=4, num_stages=3, **options)
        return launcher._signature(grid, (tensor, integer, scale), {"BLOCK": block}, options, device=device)

    reference = signature(aligned, 16, 0.5)
    assert signature(aligned.clone(), 16, 0.25) == reference  # same dtype and alignment; a float's value is data
    assert signature(aligned[1:], 16, 0.5) != reference  # 2 bytes off: not 16-byte aligned any more
    assert signature(aligned.float(), 16, 0.5) != reference
    assert signature(aligned, 17, 0.5) != reference  # % 16 and == 1 are specialised: ints are keyed by value
    assert signature(aligned, 16, 0.5, grid=(2, 1, 1)) != reference
    assert signature(aligned, 16, 0.5, block=32) != reference
    # Compile options: each its own kernel, and keyed by name (True == 1 must not make two options collide).
    assert signature(aligned, 16, 0.5, launch_pdl=True) != reference
    assert signature(aligned, 16, 0.5, launch_pdl=True) != signature(aligned, 16, 0.5, maxnreg=1)
    assert signature(aligned, 16, 0.5, device=1) != reference
    assert signature(aligned, None, 0.5) is None  # an argument it does not key: left to Triton's JIT


def test_signature_keys_a_parameter_as_its_tensor():
    """A projection's weight is an ``nn.Parameter``: the GEMV's launches must key it as the tensor it is, or every
    eager GEMV goes through Triton's JIT (its host time). Other tensor subclasses stay unkeyed."""
    launcher = CachedLauncher(_attention_with_kv_cache_kernel)
    tensor = torch.zeros(64, dtype=torch.float16)

    def signature(argument):
        options = dict(num_warps=4, num_stages=3)
        return launcher._signature((1, 1, 1), (argument, 16, 0.5), {"BLOCK": 16}, options, device=0)

    assert signature(tensor) is not None
    assert signature(torch.nn.Parameter(tensor, requires_grad=False)) == signature(tensor)

    class Subclass(torch.Tensor):
        pass

    assert signature(tensor.as_subclass(Subclass)) is None


@pytest.mark.skipif(TensorDescriptor is None, reason="triton without Gluon's host TMA descriptors")
def test_signature_keys_tma_descriptors_on_dtype_and_block():
    from triton.experimental.gluon import language as gl

    launcher = CachedLauncher(_attention_with_kv_cache_kernel)
    layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    options = dict(num_warps=4, num_stages=2)

    def signature(cache, block_rows=64):
        descriptor = TensorDescriptor.from_tensor(cache, [block_rows, 128], layout)
        return launcher._signature((1, 1, 1), (cache, descriptor), {}, options, device=0)

    cache = torch.zeros(256, 128, dtype=torch.bfloat16)
    reference = signature(cache)
    assert reference is not None
    assert signature(torch.zeros(512, 128, dtype=torch.bfloat16)) == reference  # shape and base: runtime values
    assert signature(cache, block_rows=32) != reference
    assert signature(cache.half()) != reference


@pytest.mark.skipif(not hasattr(triton.knobs.runtime.launch_enter_hook, "calls"), reason="triton without HookChain")
def test_empty_hook_chain_is_no_hook(monkeypatch):
    """Triton's launch hooks are HookChains that always exist; only a chain with a hook in it (a profiler's)
    must send launches through the JIT, which calls the hooks."""
    runtime = triton.knobs.runtime
    chain_type = type(runtime.launch_enter_hook)
    monkeypatch.setattr(runtime, "launch_enter_hook", chain_type())
    monkeypatch.setattr(runtime, "launch_exit_hook", chain_type())
    assert not _launch_hooks_set()
    runtime.launch_exit_hook.add(lambda *args: None)
    assert _launch_hooks_set()
    monkeypatch.setattr(runtime, "launch_exit_hook", None)
    assert not _launch_hooks_set()


@pytest.mark.parametrize(
    ("device_type", "capability", "interpreter", "expected"),
    [
        ("cuda", (9, 0), "0", True),  # Hopper: griddepcontrol exists
        ("cuda", (10, 0), "0", True),
        ("cuda", (8, 0), "0", False),  # Ampere: the PTX would not assemble
        ("cuda", (9, 0), "1", False),  # the interpreter cannot run gdc_wait
        ("cpu", None, "0", False),
    ],
)
def test_programmatic_launch_only_where_it_runs(device_type, capability, interpreter, expected, monkeypatch):
    """Kernels are launched with PDL (and compiled with their gdc_wait branch) only on sm_90+ outside the
    interpreter; everywhere else the USE_PDL branch is compiled out."""
    monkeypatch.setenv("TRITON_INTERPRET", interpreter)
    monkeypatch.setattr(flashcore.backends, "_interpreter_at_import", None)  # read the variable again, once
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    uses_programmatic_launch.cache_clear()
    try:
        assert uses_programmatic_launch(torch.device(device_type, 0)) is expected
    finally:
        uses_programmatic_launch.cache_clear()


def _misaligned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The same values in storage that starts one element (2 bytes) past a 16-byte boundary."""
    storage = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
    return storage[1:].view(tensor.shape).copy_(tensor)


@pytest.mark.parametrize("num_new", [1, 6])
def test_repeated_calls_alternating_alignment(num_new, device, generator):
    """The same shapes four times, q/k/v alternately aligned and not. On the GPU the third and fourth calls
    take the direct launch (one signature each for aligned and misaligned), split-KV path included."""
    dtype = torch.float16
    for step in range(4):
        inputs = make_call_inputs(
            randn,
            generator=generator,
            dtype=dtype,
            device=device,
            num_q_heads=4,
            num_kv_heads=2,
            num_new=num_new,
            head_dim=32,
            capacity=256,
            seq_lens=[100, 37],
            query_lens=[num_new, num_new],
        )
        if step % 2:
            inputs.query, inputs.key, inputs.value = (
                _misaligned_copy(t) for t in (inputs.query, inputs.key, inputs.value)
            )
        out, returned = flashcore.attention_with_kv_cache(
            inputs.query, inputs.key, inputs.value, inputs.cache, backend="triton"
        )
        check_call(inputs, out, returned, atol=TOLERANCES[dtype], is_causal=True)
    if torch.device(device).type == "cuda":  # the direct launch was set up (the interpreter always takes the JIT)
        compiled_kernels = [compiled for compiled, _ in triton_attention._launch_attention._compiled.values()]
        assert compiled_kernels
        # On Hopper and later every launch is a programmatic dependent launch, the direct one included: the
        # compiled kernel's own launcher reads the option from its metadata.
        uses_pdl = uses_programmatic_launch(torch.device(device))
        assert all(bool(compiled.metadata.launch_pdl) == uses_pdl for compiled in compiled_kernels)


def test_kernels_as_captured_picks_the_capture_variants():
    """An eager warm-up of a step to be captured launches what the capture will: the split merge in its own launch."""
    from flashcore.backends import kernels_as_captured, picks_captured_kernels
    from flashcore.kernels.triton.split_merge import merges_in_attention_launch

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    with kernels_as_captured():
        assert picks_captured_kernels(cuda) and not merges_in_attention_launch(cuda)
        with kernels_as_captured():
            pass
        assert picks_captured_kernels(cuda)  # a nested exit keeps the outer context
        assert not picks_captured_kernels(cpu) and merges_in_attention_launch(cpu)
    assert merges_in_attention_launch(cpu)


def test_cycle_collector_paused_restores_what_it_found():
    """A capture pauses Python's cycle collector (a dropped session's graphs torn down mid-capture invalidate it) and
    leaves it as it was, after an error too."""
    import gc

    from flashcore.backends import cycle_collector_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with cycle_collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with cycle_collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a caller's own pause stays
    finally:
        gc.enable()
