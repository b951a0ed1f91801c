"""``CachedLauncher``: launches a ``@triton.jit`` kernel without re-running Triton's argument binder every call.

``kernel[grid](*args)`` re-derives the kernel's specialisation from every argument on every call (dtype and
16-byte alignment of each pointer, ``== 1`` and ``% 16`` of each integer) before it finds the compiled kernel
and calls its launcher. On the H100 test host that binder is most of a launch's host time (attention kernel,
46 arguments: ``kernel[grid]`` against calling the compiled launcher directly; benchmarks/NOTES.md, entry 23).
A decode call's GPU work is shorter than that, so in eager mode this host cost is the call's cost.

The first launch of a signature goes through Triton's JIT (which compiles if needed) and keeps the compiled
kernel. Later launches with the same signature call its launcher directly. The signature is exact: the grid,
the launch options, every constexpr, every integer argument's value, and each tensor's dtype, device and
16-byte alignment, a superset of what Triton specialises on. So a direct launch runs the very kernel the
JIT would pick. Anything this does not handle takes the JIT path: the interpreter, launch hooks (profilers
set them), and non-tensor, non-int, non-float arguments.
"""

from __future__ import annotations

import functools

import torch
import triton

from flashcore.backends import triton_interpreter_enabled

try:  # host-side TMA descriptors, the warp-specialised decode kernel's K/V arguments
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:
    TensorDescriptor = None

MAX_CACHED_SIGNATURES = 4096  # per kernel; a new shape adds one, so only a pathological caller reaches this


@functools.cache
def uses_programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with programmatic dependent launch (PDL): Hopper and later.

    A PDL launch may start while the previous kernel in the stream still runs; the kernel's ``USE_PDL`` branch
    waits for it (``gdc_wait``) before its first memory access, so only the launch latency overlaps
    (benchmarks/NOTES.md, entry 25). The interpreter has no grid dependencies to wait on, and cannot run the wait.
    """
    if device.type != "cuda" or triton_interpreter_enabled():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _launch_hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:  # a triton without knobs: always go through the JIT
        return True
    return _is_hook_set(runtime.launch_enter_hook) or _is_hook_set(runtime.launch_exit_hook)


def _is_hook_set(hook) -> bool:
    # In recent triton (3.6 on the H100 test host, 3.9 on CI) each hook is a HookChain that is always there, and
    # an empty chain means no hook. Testing ``is not None`` alone took it for a hook: on triton 3.6 every call
    # went through the JIT (NOTES.md, entry 23).
    calls = getattr(hook, "calls", None)
    return hook is not None and (calls is None or len(calls) > 0)


class CachedLauncher:
    """Call as ``launcher(grid, args, constexprs, num_warps=..., num_stages=..., launch_pdl=..., maxnreg=...)``.

    ``args`` are the kernel's runtime arguments in signature order (tensors, TMA descriptors, ints, floats), the
    first a tensor (its device picks the path); ``constexprs`` maps every constexpr name to its value.
    ``launch_pdl`` and ``maxnreg`` are Triton's compile options of those names (the compiled kernel's launcher
    then sets the launch attributes itself).
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._constexpr_names = None  # in signature order, read from the kernel on first use
        self._compiled: dict[tuple, tuple] = {}

    def __call__(
        self,
        grid: tuple,
        args: tuple,
        constexprs: dict,
        *,
        num_warps: int,
        num_stages: int,
        launch_pdl: bool = False,
        maxnreg: int | None = None,
    ) -> None:
        options = dict(num_warps=num_warps, num_stages=num_stages)
        # Only a launch that names an option passes it, so a kernel launched without it compiles as it always did.
        if launch_pdl:
            options["launch_pdl"] = True
        if maxnreg is not None:
            options["maxnreg"] = maxnreg
        if not args[0].is_cuda or _launch_hooks_set():
            self._launch_through_jit(grid, args, constexprs, options)
            return
        # Triton launches on the current device's current stream, whatever device the tensors are on: so does
        # the direct launch, and the device is part of the signature because the compiled function is per device.
        device = torch.cuda.current_device()
        key = self._signature(grid, args, constexprs, options, device)
        entry = self._compiled.get(key) if key is not None else None
        if entry is None:
            compiled = self._launch_through_jit(grid, args, constexprs, options)
            if key is not None:
                self._remember(key, compiled, constexprs)
            return
        compiled, constexpr_values = entry
        # Triton's own stream getter: the raw handle, without building a torch.cuda.Stream object per call.
        stream = triton.runtime.driver.active.get_current_stream(device)
        compiled.run(
            grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
            None, None, None,  # launch metadata and enter/exit hooks: none are set (checked above)
            *args, *constexpr_values,
        )  # fmt: skip

    def _launch_through_jit(self, grid, args, constexprs, options):
        return self.kernel[grid](*args, **constexprs, **options)

    def _signature(self, grid, args, constexprs, options, device: int) -> tuple | None:
        """The launch's signature, or None for an argument type this does not key (the JIT path takes it).

        Exact type tests rather than isinstance: this runs on every eager call, over ~46 arguments, and on the
        H100 test host the isinstance chain was a measurable part of it (NOTES.md, entry 23).
        Subclasses (a bool, a tensor subclass) are not keyed and take the JIT path.
        """
        key = [grid, *options.items(), device, *constexprs.values()]
        append = key.append
        for arg in args:
            kind = type(arg)
            if kind is int:
                append(arg)
            elif kind is torch.Tensor:
                append(arg.dtype)
                append(arg.data_ptr() % 16 == 0)
            elif kind is float:
                append(float)  # always passed as fp32: the value does not change the kernel
            elif kind is TensorDescriptor:
                # Triton specialises a descriptor on its dtype, block shape and layout (a function of the two);
                # its base, shape and strides are runtime values, encoded by the compiled launcher.
                append((arg.base.dtype, tuple(arg.block_shape), arg.base.data_ptr() % 16 == 0))
            else:
                return None
        return tuple(key)

    def _remember(self, key: tuple, compiled, constexprs: dict) -> None:
        if compiled is None or not hasattr(compiled, "run"):
            return
        if self._constexpr_names is None:
            names = [param.name for param in self.kernel.params if param.is_constexpr]
            if set(names) != set(constexprs):
                return  # defaults or extra options in play: stay on the JIT path
            if any(param.is_constexpr for param in self.kernel.params[: -len(names) or None]):
                return  # the direct launch appends the constexprs after the runtime arguments
            self._constexpr_names = names
        if len(self._compiled) >= MAX_CACHED_SIGNATURES:
            self._compiled.clear()
        self._compiled[key] = (compiled, tuple(constexprs[name] for name in self._constexpr_names))
