"""``generate``'s compiled decode step on a patched model: ``torch.compile``'s code, flashcore's CUDA graph.

Where ``generate`` compiles the decode step (a compileable cache on CUDA, which every :class:`FlashCoreCache` is), it
asks the model's ``get_compiled_call(compile_config)`` for the callable each step runs. transformers answers
``torch.compile(model.__call__, **compile_config.to_dict())``, by default in mode ``"reduce-overhead"``, whose CUDA
graphs are inductor's CUDA-graph trees. Every step then passes dynamo's guards, the compiled wrapper's Python and
the trees' checks and copies of their inputs before the replay: on the H100's host that is most of the 1.1-1.25 ms a
step of this path spends beyond the session's step on the same kernels, in series with the device, because
``generate`` syncs once a step (``benchmarks/NOTES.md``, entry 62).

A patched model answers with a :class:`CompiledStep` instead, where the config asks for CUDA graphs on CUDA with
inductor: the same ``torch.compile`` of the forward, in the same mode minus inductor's CUDA graphs, run eagerly on
the first call of each kind (the inputs' shapes, dtypes and strides, the other arguments' values and the cache),
captured as one CUDA graph on the second, and replayed from then on, as :class:`DecodeSession` replays its step: a
call copies its tensors into the graph's inputs, replays, and returns the outputs as tensors of their own. A config
without CUDA graphs, another backend or a model off CUDA gets transformers' own compiled call.

The graph reads the weights and the cache's buffers where they were at capture: ``apply_flashcore_to_llama``
drops the captured steps (it may replace weights), and a new cache drops the last one's. A parameter replaced by a
new tensor after that (rather than copied into) needs ``apply_flashcore_to_llama`` again.
"""

from __future__ import annotations

import weakref

import torch

from flashcore.backends import captured_graph, kernels_as_captured
from flashcore.integrations.cache import FlashCoreCache

# torch.compile modes that capture CUDA graphs, and the same mode without them.
_WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
_WARM = object()  # a kind of call whose eager run happened: the next one captures it


def captures_cuda_graphs(compile_kwargs: dict) -> bool:
    """Whether ``torch.compile(**compile_kwargs)`` would capture CUDA graphs (what :class:`CompiledStep` takes over)."""
    if compile_kwargs.get("backend", "inductor") != "inductor":
        return False
    options = compile_kwargs.get("options") or {}
    return compile_kwargs.get("mode") in _WITHOUT_CUDA_GRAPHS or bool(options.get("triton.cudagraphs"))


class CompiledStep:
    """``torch.compile(model.__call__, **compile_kwargs)`` without inductor's CUDA graphs, each kind of call captured
    as a CUDA graph of its own on its second call and replayed from its third (see the module docstring).

    Args:
        model: a model patched by ``apply_flashcore_to_llama``, on one CUDA device.
        compile_kwargs: ``torch.compile``'s keyword arguments (``CompileConfig.to_dict()``) with CUDA graphs on
            (:func:`captures_cuda_graphs`).
    """

    def __init__(self, model: torch.nn.Module, compile_kwargs: dict) -> None:
        self.asked = compile_kwargs
        compile_kwargs = dict(compile_kwargs)
        if compile_kwargs.get("options"):
            compile_kwargs["options"] = {**compile_kwargs["options"], "triton.cudagraphs": False}
        if compile_kwargs.get("mode") in _WITHOUT_CUDA_GRAPHS:
            compile_kwargs["mode"] = _WITHOUT_CUDA_GRAPHS[compile_kwargs["mode"]]
        self.compile_kwargs = compile_kwargs
        self._forward = torch.compile(model.__call__, **compile_kwargs)
        # Per kind of call: _WARM, then (graph, its input tensors, its outputs).
        self._graphs: dict[tuple, object] = {}
        self._cache: weakref.ref | None = None  # the cache the graphs write; another one drops them

    @property
    def captured(self) -> int:
        """How many kinds of call replay a CUDA graph."""
        return sum(entry is not _WARM for entry in self._graphs.values())

    def __call__(self, **kwargs):
        tensors: list[torch.Tensor] = []
        key = tuple((name, _signature(value, name, tensors, self._use_cache)) for name, value in kwargs.items())
        entry = self._graphs.get(key)
        if entry is None:
            with kernels_as_captured():  # compiles the kernel variants the capture will replay
                outputs = self._forward(**kwargs)
            self._graphs[key] = _WARM  # after the run: a call that raised has not warmed anything up
            return outputs
        if entry is _WARM:
            entry = self._graphs[key] = self._capture(kwargs, tensors)
        graph, inputs, outputs = entry
        for static, tensor in zip(inputs, tensors, strict=True):
            static.copy_(tensor)
        graph.replay()
        return _own_tensors(outputs)

    def _use_cache(self, cache: FlashCoreCache) -> None:
        """Drops the graphs of another cache than ``cache``: they write that one's buffers."""
        if self._cache is None or self._cache() is not cache:
            self._graphs.clear()
            self._cache = weakref.ref(cache)

    def _capture(self, kwargs: dict, tensors: list[torch.Tensor]) -> tuple:
        inputs = [tensor.clone() for tensor in tensors]
        replaced = iter(inputs)
        static_kwargs = {name: _with_tensors(value, replaced) for name, value in kwargs.items()}
        with captured_graph() as graph:
            outputs = self._forward(**static_kwargs)
        return graph, inputs, outputs


def _signature(value, name: str, tensors: list[torch.Tensor], use_cache) -> object:
    """What a graph of this call depends on in ``value``, hashable; its tensors appended to ``tensors`` in order."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return (torch.Tensor, value.shape, value.stride(), value.dtype, value.device)
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value), value)
    if isinstance(value, FlashCoreCache):
        use_cache(value)
        return (FlashCoreCache, id(value))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_signature(item, name, tensors, use_cache) for item in value))
    if isinstance(value, dict):
        return (dict, tuple((key, _signature(item, name, tensors, use_cache)) for key, item in value.items()))
    raise NotImplementedError(
        f"generate's compiled step on a flashcore model captures calls whose arguments are tensors, numbers, "
        f"strings, None, the FlashCoreCache and tuples, lists or dicts of those; {name} is a {type(value).__name__}. "
        f"Pass disable_compile=True to generate to run this call eagerly"
    )


def _with_tensors(value, tensors):
    """``value`` with its tensors replaced, in :func:`_signature`'s order, by the next ones of ``tensors``."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (tuple, list)):
        return type(value)(_with_tensors(item, tensors) for item in value)
    if isinstance(value, dict):
        return {key: _with_tensors(item, tensors) for key, item in value.items()}
    return value


def _own_tensors(value):
    """The replay's outputs with tensors of their own: the graph's are overwritten by its next replay, and
    ``generate`` may keep some across steps (hidden states, attentions)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_own_tensors(item) for item in value)
    if isinstance(value, dict):  # ModelOutput is an OrderedDict whose fields are its items
        return type(value)(**{key: _own_tensors(item) for key, item in value.items()})
    return value
