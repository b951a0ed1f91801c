"""flashcore's serving engine: continuous batching of many requests over one patched HF model.

:class:`Engine` is the entry point (``submit`` / ``cancel`` / ``generate``); :mod:`flashcore.engine.requests`
holds what a request carries in and gets back. Needs flashcore's ``[hf]`` extra, like
:mod:`flashcore.integrations`.
"""

from flashcore.engine.engine import Engine
from flashcore.engine.requests import (
    Completion,
    EngineError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
]
