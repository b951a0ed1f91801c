"""flashcore's Hugging Face integration, installed as ``flashcore.integrations``.

:mod:`flashcore.integrations.llama` is the one entry point: ``apply_flashcore_to_llama(model, *, backend,
layer_kernels, fuse_projections)`` patches a loaded LLaMA-family model and ``remove_flashcore(model)`` undoes it; it
re-exports :class:`~flashcore.integrations.cache.FlashCoreCache`. The other modules are its parts (``attention``,
``cache``, ``layer_kernels``, ``fused_projections``, ``llama_forward_fork``) and flashcore's own decode loop
(``decode_session``). Nothing is imported here, so that ``flashcore`` itself never needs transformers. The modules
here do: they need flashcore's ``[hf]`` extra (``pip install "flashcore[hf]"``, or ``pip install -e ".[hf]"`` from a
checkout), and without it ``import flashcore.integrations.llama`` raises an ``ImportError`` that says so.
"""
