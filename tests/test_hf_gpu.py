"""The HF integration on CUDA only: a bf16 prefill reaches the Gluon prefill kernel on sm_90, and generate's own
compile of the decode step (inductor + CUDA graphs) gives eager flashcore's tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import ON_GPU, TEST_DEVICE
from hf_models import BACKENDS, bf16_llama, random_prompts, seed_of, tiny_llama

from flashcore.integrations.llama import (
    CACHE_ARGUMENT_NAME,
    FlashCoreCache,
    apply_flashcore_to_llama,
    remove_flashcore,
)
from flashcore.kernels.gluon_sm90.common import runs_on

pytest_plugins = ["hf_fixtures"]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="bf16 attention and the Gluon kernels need CUDA")
@pytest.mark.parametrize("head_dim", [64, 128])
@torch.no_grad()
def test_unpadded_bf16_prefill_runs_the_gluon_prefill_kernel(head_dim, device, generator, request, launches):
    """An HF prefill of 256 unpadded tokens in bf16 reaches the Gluon prefill kernel on sm_90 (query_lens None,
    contiguous q/k/v), through generate and through a forward with an all-ones mask; the Triton kernel elsewhere."""
    model = bf16_llama(
        seed_of(request), device, head_dim=head_dim, vocab_size=1024, hidden_size=8 * head_dim,
        intermediate_size=16 * head_dim, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    )  # fmt: skip
    apply_flashcore_to_llama(model, backend="triton")
    input_ids, attention_mask = random_prompts([256, 256], generator, device)
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=1, do_sample=False, disable_compile=True)
    model(input_ids, attention_mask=attention_mask)
    remove_flashcore(model)

    expected = "gluon_sm90.prefill" if runs_on(device) else "triton.attention"
    assert [(launch.s_q, launch.kernel, launch.query_lens) for launch in launches] == [(256, expected, None)] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or TEST_DEVICE != "cuda", reason="HF compiles the step on CUDA only")
@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_compile_matches_eager_on_gpu(backend, generator, request):
    """generate's own compile of the decode step (inductor + CUDA graphs) gives eager's tokens. fp32, so that
    inductor's fused rounding cannot flip a near-tied argmax (in bf16 stock transformers diverges too)."""
    model = tiny_llama("gqa", seed_of(request), "cuda")
    apply_flashcore_to_llama(model, backend=backend)
    prompts, mask = random_prompts([9, 5], generator, "cuda")
    outputs = {}
    for mode in ("eager", "compiled"):
        cache = FlashCoreCache(model.config, max_cache_len=9 + 24)
        outputs[mode] = model.generate(
            prompts, attention_mask=mask, **{CACHE_ARGUMENT_NAME: cache}, max_new_tokens=24, do_sample=False,
            disable_compile=(mode == "eager"),
        )  # fmt: skip
    remove_flashcore(model)
    assert torch.equal(outputs["eager"], outputs["compiled"])


_FIRST_DECODE_COMPILED = """
import torch
from hf_models import bf16_llama
from flashcore.integrations.llama import apply_flashcore_to_llama

sizes = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1024)
# The layer kernels: compiled steps compute eager's bits, so the eager run after them is the reference.
model = apply_flashcore_to_llama(bf16_llama(0, torch.device("cuda"), **sizes), layer_kernels=True)
prompt = torch.randint(1, 1024, (1, 512), device="cuda")
compiled = [model.generate(prompt, max_new_tokens=8, do_sample=False) for _ in range(2)]
eager = model.generate(prompt, max_new_tokens=8, do_sample=False, disable_compile=True)
assert eager.shape == (1, 520) and all(torch.equal(out, eager) for out in compiled), (compiled, eager)
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="generate compiles its decode step with CUDA graphs on CUDA only")
def test_compiled_generate_whose_first_decode_allocates_the_split_scratch():
    """HF's compiled generate at B=1 in a fresh process, whose first flashcore decode step is a compiled one and the
    first to need the split-KV scratch: two calls run and give the eager tokens (with the layer kernels, a compiled
    step computes eager's bits). The scratch used to be allocated inside a warm-up run of the CUDA-graph trees, in
    their private pool, and the next recording refused it ("tensors in the cudagraph pool not tracked as outputs")."""
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run(
        [sys.executable, "-c", _FIRST_DECODE_COMPILED],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
