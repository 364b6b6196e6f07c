"""Python side of the Dawn/Tint lane: starts `worker.mjs` under Node once and exchanges JSON lines with it.

The worker (see its header for the job format) has two adapters, both with the WebGPU default limits:
"null" (Dawn's null backend: Tint validates every shader, shader-f16 and subgroups included; outputs are
garbage) and "vulkan" (the Vulkan driver named by DOPPLER_DAWN_VK_ICD, by default Chrome's SwiftShader ICD
from the Debian `chromium` package, which runs f32 kernels for real).

What was probed here (npm webgpu 0.6.2, Debian bookworm, Chromium 156):
* SwiftShader 5.0.0 (Subzero JIT): works; subgroups yes, shader-f16 no. Several times slower than lavapipe
  on barrier-heavy kernels (the sampler: ~1-2 s per test submit).
* Debian's Mesa 22.3 lavapipe: Dawn rejects it ("Vulkan shaderUniform*ArrayDynamicIndexing required").
* Mesa 25.0.7 lavapipe from bookworm-backports (debs mesa-vulkan-drivers, libdrm2, libdrm-amdgpu1 unpacked
  into a folder; its lvp ICD json with an absolute library_path; LD_LIBRARY_PATH for the newer libdrm): works,
  with shader-f16 and subgroups, ~10x faster than SwiftShader. Select it with DOPPLER_DAWN_VK_ICD=<its json>.

When Node, the npm package or the Vulkan driver is missing the lane skips with the reason, except under
CI=true, where a missing tool is a failure: CI installs them (tools/bootstrap.sh).
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from doppler_py.gpu.kernels import Binding
from doppler_py.parity.doppler_model import SWIFTSHADER_ICD

PARITY_DIR = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "worker.mjs"
NODE_MAJOR = 20
START_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 300.0


class DawnUnavailable(RuntimeError):
    """The lane's tools are missing; the message says what to install."""


class DawnWorkerError(RuntimeError):
    """The worker died or stopped answering."""


@dataclass(frozen=True)
class Adapter:
    name: str  # "null" or "vulkan"
    description: str
    features: frozenset[str]
    limits: dict[str, int]


@dataclass(frozen=True)
class DawnResult:
    ok: bool
    errors: tuple[str, ...]
    notes: tuple[str, ...]  # Tint's info/warning lines, which explain an error (e.g. uniformity)
    buffers: dict[str, bytes]
    ms: float

    def describe(self) -> str:
        return "\n".join([*self.errors, *self.notes])


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_or_fail(reason: str) -> None:
    """The lane is optional locally but mandatory in CI, which installs its tools."""
    if in_ci():
        pytest.fail(f"Dawn lane cannot run under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def b64(data: bytes | memoryview) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def pipeline_spec(module: str, entry: str, constants: dict[str, float], bindings: Iterable[Binding]) -> dict:
    """A pipeline with the same explicit bind group layout the kernel registry builds."""
    return {
        "module": module,
        "entry": entry,
        "constants": {k: float(v) for k, v in constants.items()},
        "layout": [{"binding": b.index, "type": b.kind} for b in bindings],
    }


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    if SWIFTSHADER_ICD.is_file():
        # Older Vulkan loaders read VK_ICD_FILENAMES, newer ones prefer VK_DRIVER_FILES: set both.
        env["VK_ICD_FILENAMES"] = env["VK_DRIVER_FILES"] = str(SWIFTSHADER_ICD)
    xdg = env.get("XDG_RUNTIME_DIR")
    if not xdg or not os.path.isdir(xdg):
        # The Vulkan loader prints a warning per start when this is unset.
        xdg = os.path.join(tempfile.gettempdir(), f"doppler-xdg-{os.getuid()}")
        os.makedirs(xdg, mode=0o700, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = xdg
    return env


def _find_node() -> str:
    node = shutil.which("node")
    if node is None:
        raise DawnUnavailable("node is not installed (Debian: apt-get install nodejs npm; Node >= 20)")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    major = int(version.lstrip("v").split(".")[0] or 0) if version.startswith("v") else 0
    if major < NODE_MAJOR:
        raise DawnUnavailable(f"node {version or '?'} is too old; the npm package webgpu needs Node >= {NODE_MAJOR}")
    if not (PARITY_DIR / "node_modules" / "webgpu").is_dir():
        raise DawnUnavailable(f"npm package webgpu is not installed: run `npm ci` in {PARITY_DIR}")
    return node


class DawnWorker:
    """One `node worker.mjs` process; `run(job)` sends a job and waits for its result."""

    def __init__(self, process: subprocess.Popen, adapters: dict[str, Adapter], lines: queue.Queue, stderr: deque):
        self._process = process
        self._lines = lines
        self._stderr = stderr
        self._next_id = 0
        self.adapters = adapters

    @classmethod
    def start(cls) -> DawnWorker:
        node = _find_node()
        process = subprocess.Popen(
            [node, str(WORKER)],
            cwd=PARITY_DIR,
            env=_worker_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        lines: queue.Queue = queue.Queue()
        stderr: deque = deque(maxlen=40)
        threading.Thread(target=_pump, args=(process.stdout, lines.put), daemon=True).start()
        threading.Thread(target=_pump, args=(process.stderr, stderr.append, False), daemon=True).start()
        worker = cls(process, {}, lines, stderr)
        hello = worker._read(START_TIMEOUT_S)
        adapters = {}
        for name, info in (hello.get("adapters") or {}).items():
            if info:
                description = " ".join(str(info.get(k, "")) for k in ("vendor", "architecture", "description"))
                adapters[name] = Adapter(
                    name, description.strip() or info.get("device", ""), frozenset(info["features"]), info["limits"]
                )
        worker.adapters = adapters
        return worker

    def require(self, adapter: str) -> Adapter:
        """The adapter, or a skip (a failure under CI) saying what is missing."""
        if adapter not in self.adapters:
            if adapter == "vulkan":
                skip_or_fail(
                    f"no Dawn Vulkan adapter: Chrome's SwiftShader ICD {SWIFTSHADER_ICD} is missing "
                    "(Debian: apt-get install chromium) or Dawn rejected it"
                )
            skip_or_fail(f"Dawn has no {adapter!r} adapter here")
        return self.adapters[adapter]

    def run(self, job: dict, timeout: float = JOB_TIMEOUT_S) -> DawnResult:
        self._next_id += 1
        job = {**job, "id": self._next_id}
        try:
            self._process.stdin.write(json.dumps(job, separators=(",", ":")) + "\n")
            self._process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise DawnWorkerError(f"Dawn worker is gone: {exc}\n{self.stderr_tail()}") from exc
        answer = self._read(timeout)
        if answer.get("id") != job["id"]:
            raise DawnWorkerError(f"Dawn worker answered job {answer.get('id')} to job {job['id']}")
        errors = tuple(_format_message(e) for e in answer.get("errors", []))
        return DawnResult(
            ok=bool(answer.get("ok")),
            errors=errors,
            notes=tuple(_format_message(w) for w in answer.get("warnings", [])),
            buffers={k: base64.b64decode(v) for k, v in (answer.get("buffers") or {}).items()},
            ms=float(answer.get("ms", 0.0)),
        )

    def _read(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            # A late answer would be taken for the next job's: stop this worker (the next use starts a new one).
            self._process.kill()
            raise DawnWorkerError(f"Dawn worker did not answer within {timeout:.0f} s\n{self.stderr_tail()}") from None
        if line is None:
            code = self._process.wait(timeout=5)
            raise DawnWorkerError(f"Dawn worker exited with code {code}\n{self.stderr_tail()}")
        return json.loads(line)

    def stderr_tail(self) -> str:
        return "".join(self._stderr)

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def _pump(stream, put, mark_end: bool = True) -> None:
    for line in stream:
        put(line)
    if mark_end:
        put(None)


def _format_message(message: dict) -> str:
    where = f"{message['pipeline']}: " if message.get("pipeline") else ""
    return f"[{message.get('stage', '?')}] {where}{message.get('message', '').strip()}"


_shared: dict[str, DawnWorker | DawnUnavailable] = {}


def shared_worker() -> DawnWorker:
    """The process-wide worker (started on first use, restarted if it died); raises `DawnUnavailable`."""
    current = _shared.get("worker")
    if isinstance(current, DawnUnavailable):
        raise current
    if current is None or not current.alive:
        try:
            _shared["worker"] = DawnWorker.start()
        except DawnUnavailable as exc:
            _shared["worker"] = exc
            raise
        atexit.register(close_shared_worker)
    return _shared["worker"]


def close_shared_worker() -> None:
    current = _shared.pop("worker", None)
    if isinstance(current, DawnWorker):
        current.close()
