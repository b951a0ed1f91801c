"""flashcore's Hugging Face integration, installed as ``flashcore.integrations``.

:mod:`flashcore.integrations.llama` patches a loaded LLaMA-family model (``apply_flashcore_to_llama``) and
re-exports :class:`~flashcore.integrations.cache.FlashCoreCache`. Nothing is imported here, so that ``flashcore``
itself never needs transformers.
"""
