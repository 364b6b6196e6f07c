"""Measured verification costs kept on disk, so a new process on the same device and model starts warm.

The policy needs cost(T rows) / cost(1 row) of THIS device before speculation can be judged; measuring it takes
a calibration (~1.5 s on lavapipe once its pipelines exist). The costs are stored per key: the adapter (name,
driver, backend, features, limits), the host (CPU count: software adapters run on it), the model files (path,
size, modification time of every weight and config file), the weight precision, the engine's row limits and a
digest of the shaders. When any of these changes the key changes, so stale costs are never read; a file that
cannot be parsed is ignored (and rewritten by the next calibration).

Files: `cache_dir("verify-costs")/<sha256 of the key>.json` = {"key": {...}, "verify": {"rows": seconds}}.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

from doppler_py.gpu.device import Gpu
from doppler_py.gpu.wgsl import SHADER_DIR
from doppler_py.paths import cache_dir

_MODEL_SUFFIXES = (".safetensors", ".gguf", ".json")


def cost_key(gpu: Gpu, model_folder: Path, weights: str, *, max_rows: int, capacity: int) -> dict:
    """Everything the measured costs depend on."""
    files = sorted(p for p in Path(model_folder).iterdir() if p.is_file() and p.suffix in _MODEL_SUFFIXES)
    shaders = hashlib.sha256()
    for shader in sorted(SHADER_DIR.glob("*.wgsl")):
        shaders.update(shader.read_bytes())
    return {
        "gpu": gpu.summary(),
        "cpus": os.cpu_count(),
        "lavapipe_threads": os.environ.get("LP_NUM_THREADS"),
        "model": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        "weights": weights,
        "max_rows": max_rows,
        "capacity": capacity,
        "shaders": shaders.hexdigest(),
    }


def _path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir("verify-costs") / f"{digest[:32]}.json"


def load_costs(key: dict) -> dict[int, float] | None:
    """The costs stored under `key`, or None (never measured, or an unreadable file)."""
    try:
        record = json.loads(_path(key).read_text())
        if record["key"] != json.loads(json.dumps(key)):
            return None
        costs = {int(rows): float(seconds) for rows, seconds in record["verify"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return costs if costs and all(c > 0 for c in costs.values()) else None


def measured_here(gpu: Gpu) -> list[dict]:
    """What the cache holds for this adapter and host: one record per model folder, weights and row limits
    measured ({"model": folder name, "weights", "capacity", "rows": row counts}), for `doppler-py info`."""
    here = json.loads(json.dumps({"gpu": gpu.summary(), "cpus": os.cpu_count()}))
    found = []
    for path in sorted(cache_dir("verify-costs").glob("*.json")):
        try:
            record = json.loads(path.read_text())
            key = record["key"]
            if key["gpu"] != here["gpu"] or key["cpus"] != here["cpus"]:
                continue
            model = Path(key["model"][0][0]).parent.name if key["model"] else "?"
            rows = sorted(int(r) for r in record["verify"])
            found.append({"model": model, "weights": key["weights"], "capacity": key["capacity"], "rows": rows})
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
    return found


def save_costs(key: dict, costs: dict[int, float]) -> bool:
    """Store `costs` under `key` (written to a temporary file, then renamed: readers never see half a file).

    It runs in the middle of a generation: a cache that cannot be written (read-only, full disk) costs only
    a warning and the next process's calibration, never the generation. Returns whether the costs were stored.
    """
    try:
        path = _path(key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "verify": {str(r): c for r, c in sorted(costs.items())}}, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"the measured verification costs could not be cached ({exc})", RuntimeWarning, stacklevel=2)
        return False
    return True
