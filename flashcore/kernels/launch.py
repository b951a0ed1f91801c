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
import inspect

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

    A PDL launch may start once the kernel before it in the stream releases it (``gdc_launch_dependents``, or that
    kernel's end), and its ``USE_PDL`` branch waits for that kernel to finish (``gdc_wait``) before it reads what that
    kernel writes (benchmarks/NOTES.md, entry 25). flashcore's kernels keep two rules, which make each read before a
    wait safe:

    - a kernel releases the next one after its own wait, so when a kernel starts, all but the one right before it
      have finished. The split merge is the exception: it releases first, so that a model's o projection streams its
      weight during the attention (entry 59), and the attention launch before it may still run;
    - before its wait a kernel reads only what no kernel that may still run writes: the GEMV its weight (entry 53),
      the RMSNorm kernel its weight (entry 90), the Gluon decode kernel ``seq_lens`` and the cached prefix (entry 59;
      right after this cache's own split merge it waits first, ``split_merge.follows_merge_of``).

    Inductor's PDL kernels (a compiled ``DecodeSession`` step) wait before their first load and release after their
    last, which keeps the first rule. The interpreter has no grid dependencies to wait on, and cannot run the wait.
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
        options = _compile_options(num_warps, num_stages, launch_pdl, maxnreg)
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

    def bind(
        self,
        grid: tuple,
        args: tuple,
        constexprs: dict,
        *,
        varying: tuple[int, ...],
        num_warps: int,
        num_stages: int,
        launch_pdl: bool = False,
        maxnreg: int | None = None,
    ) -> BoundLaunch | None:
        """A :class:`BoundLaunch` of the kernel this launch signature compiled to, or None where there is none yet.

        Call it after launching ``args`` once through ``self``: the signature is then known. ``varying`` lists the
        positions of the tensor arguments that will change from launch to launch (their addresses); every other
        argument is kept as it is now. None for a launch that went through Triton's JIT (the interpreter, launch
        hooks, an argument the signature does not key) or whose varying tensors are not 16-byte aligned.
        """
        options = _compile_options(num_warps, num_stages, launch_pdl, maxnreg)
        if not args[0].is_cuda or _launch_hooks_set():
            return None
        if any(args[position].data_ptr() % 16 for position in varying):
            return None
        device = torch.cuda.current_device()
        key = self._signature(grid, args, constexprs, options, device)
        entry = self._compiled.get(key) if key is not None else None
        if entry is None:
            return None
        compiled, constexpr_values = entry
        return BoundLaunch(compiled, grid, args, constexpr_values, varying, device)

    def _launch_through_jit(self, grid, args, constexprs, options):
        return self.kernel[grid](*args, **constexprs, **options)

    def _signature(self, grid, args, constexprs, options, device: int) -> tuple | None:
        """The launch's signature, or None for an argument type this does not key (the JIT path takes it).

        Exact type tests rather than isinstance: this runs on every eager call, over ~46 arguments, and on the
        H100 test host the isinstance chain was a measurable part of it (NOTES.md, entry 23).
        ``nn.Parameter`` is keyed as the tensor it is to the kernel (the GEMV takes a projection's weight); other
        subclasses (a bool, any other tensor subclass) are not keyed and take the JIT path.
        """
        key = [grid, *options.items(), device, *constexprs.values()]
        append = key.append
        for arg in args:
            kind = type(arg)
            if kind is int:
                append(arg)
            elif kind is torch.Tensor or kind is torch.nn.Parameter:
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


def _compile_options(num_warps: int, num_stages: int, launch_pdl: bool, maxnreg: int | None) -> dict:
    options = dict(num_warps=num_warps, num_stages=num_stages)
    # Only a launch that names an option passes it, so a kernel launched without it compiles as it always did.
    if launch_pdl:
        options["launch_pdl"] = True
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return options


class BoundLaunch:
    """Launches of one compiled kernel whose arguments change only in a few tensor addresses.

    Made by :meth:`CachedLauncher.bind` for a launch that a caller repeats with the same shapes, the same constants
    and the same long-lived buffers (the Gluon decode kernel's eager calls, once per layer and step). It holds the
    launch's arguments with every tensor replaced by its address, which the compiled launcher takes as it takes a
    tensor, so it keeps no tensor alive. :meth:`launch` puts new addresses at the varying positions and calls the
    compiled launcher: no signature to build, no binder. That is exact only if nothing else differs, which the
    caller guarantees by keying its bound launches on everything else (shapes, strides, dtypes, devices, constants,
    the fixed buffers' addresses); :meth:`launch` checks the rest of the signature that can change under it: the
    new addresses' 16-byte alignment, launch hooks and the current device.

    Host TMA descriptors among the fixed arguments are encoded once, here, where triton exposes the C launcher
    beneath its own (:func:`_descriptor_launcher`); elsewhere the compiled launcher encodes them on every launch.
    """

    __slots__ = ("_compiled", "_grid", "_template", "_varying", "_device", "_raw_launch", "_raw_prefix")

    def __init__(self, compiled, grid: tuple, args: tuple, constexpr_values: tuple, varying: tuple, device: int):
        self._compiled = compiled
        self._grid = grid
        template = [arg.data_ptr() if type(arg) is torch.Tensor else arg for arg in (*args, *constexpr_values)]
        self._raw_launch = None
        raw = _descriptor_launcher(compiled)
        if raw is not None:
            c_launch, descriptor_positions, encode = raw
            # Each descriptor becomes the encoded map and its shape and strides: the positions after it move.
            expanded, moved = [], {}
            for position, arg in enumerate(template):
                moved[position] = len(expanded)
                if position in descriptor_positions:
                    expanded.extend(encode(arg, descriptor_positions[position]))
                else:
                    expanded.append(arg)
            template, varying = expanded, tuple(moved[position] for position in varying)
            run = compiled.run
            self._raw_launch = c_launch
            self._raw_prefix = (
                compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,  # no scratch: checked
                compiled.packed_metadata, None, None, None,  # launch metadata and hooks: none
            )  # fmt: skip
        self._template = template
        self._varying = varying
        self._device = device

    def launch(self, *addresses: int) -> bool:
        """Launches with ``addresses`` at the varying positions (in ``varying``'s order); False, launching
        nothing, where the bound signature no longer holds (the caller then launches the normal way)."""
        for address in addresses:
            if address % 16:
                return False
        if _launch_hooks_set() or torch.cuda.current_device() != self._device:
            return False
        args = self._template.copy()
        for position, address in zip(self._varying, addresses, strict=True):
            args[position] = address
        grid = self._grid
        stream = triton.runtime.driver.active.get_current_stream(self._device)
        if self._raw_launch is not None:
            self._raw_launch(grid[0], grid[1], grid[2], stream, *self._raw_prefix, *args)
        else:
            compiled = self._compiled
            compiled.run(
                grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *args
            )
        return True


def _descriptor_launcher(compiled):
    """``(C launcher, {argument position: descriptor metadata}, encode)`` from beneath triton 3.6's launcher, else
    None.

    Triton 3.6's compiled launcher (``CudaLauncher`` in ``triton/backends/nvidia/driver.py``) wraps its C launcher in
    a closure (``wrap_handle_tensordesc``'s ``inner``) that walks every argument in Python and encodes each host TMA
    descriptor (``make_tensordesc_arg``, a ``cuTensorMapEncodeTiled``) on every launch: about half of the compiled
    launcher's host time for the Gluon decode kernel's two descriptors on the H100 machine (NOTES.md, entry 40).
    This reads the C launcher, the descriptors' positions and their metadata out of that closure, so a bound launch
    encodes its fixed descriptors once and calls the C launcher with the same arguments the closure would build.
    Anything else (another triton, whose launcher is built differently, a kernel that needs scratch memory) gives
    None and keeps the compiled launcher.
    """
    run = compiled.run
    wrapper = getattr(run, "launch", None)
    if getattr(wrapper, "__name__", None) != "inner" or wrapper.__closure__ is None:
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    cells = dict(zip(wrapper.__code__.co_freevars, (cell.cell_contents for cell in wrapper.__closure__), strict=True))
    if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
        return None
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except ImportError:
        return None
    if list(inspect.signature(make_tensordesc_arg).parameters) != ["arg", "metadata"]:
        return None
    positions = sorted(cells["tensordesc_indices"])
    metadata = cells["tensordesc_meta"] or [None] * len(positions)
    return cells["launcher"], dict(zip(positions, metadata, strict=True)), make_tensordesc_arg
