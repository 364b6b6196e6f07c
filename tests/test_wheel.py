"""The package as a user installs it: a wheel built from this checkout, in a fresh virtual environment, run from
a folder outside the checkout, must carry and use its own shaders and data (an editable install hides a
missing file, since it reads the checkout).

To stay fast and offline the wheel is built with this environment's setuptools (no build isolation), installed
without dependencies, and the fresh environment reaches this environment's installed dependencies through a
`.pth` file. A `.pth` line naming a folder only appends it to `sys.path`, so the `.pth` files inside that folder
(the editable install's import hook among them) never run there: the checkout cannot shadow the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from doppler_py.testing.tiny import write_tiny_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _run(command: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    run = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{command} exited {run.returncode}\n{run.stdout}\n{run.stderr}"
    return run


def _build_inputs(into: Path) -> Path:
    """A copy of what the build reads: building in the checkout itself would leave build/ there, whose stale
    files a later build can ship."""
    into.mkdir()
    for path in ROOT.iterdir():
        if path.is_file():
            shutil.copy2(path, into / path.name)
    for folder in ("doppler_py", "shaders"):
        shutil.copytree(ROOT / folder, into / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return into


def _package_files() -> set[str]:
    """Every file of doppler_py/ that the project tracks (all of them are code or data the package reads)."""
    git = shutil.which("git")
    listed = git and subprocess.run([git, "ls-files", "doppler_py"], cwd=ROOT, capture_output=True, text=True)
    if listed and listed.returncode == 0:
        names = listed.stdout.splitlines()
    else:  # not a git checkout: the modules at least
        names = [str(p.relative_to(ROOT)) for p in (ROOT / "doppler_py").rglob("*.py") if "__pycache__" not in p.parts]
    return {name for name in names if (ROOT / name).is_file()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", reason="the wheel is built with this environment's setuptools, offline")
    scratch = tmp_path_factory.mktemp("wheel")
    source = _build_inputs(scratch / "source")
    env = os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index"]
    _run([*command, "-q", "-w", str(scratch / "dist")], env, scratch)
    (built,) = (scratch / "dist").glob("doppler_py-*.whl")
    return built


def test_the_wheel_holds_every_shader_and_package_file(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    shaders = {f"doppler_py/shaders/{p.name}" for p in (ROOT / "shaders").glob("*.wgsl")}
    assert shaders, "no shaders/*.wgsl in the checkout"
    assert shaders <= names, f"missing from the wheel: {sorted(shaders - names)}"
    missing = _package_files() - names  # a subpackage left out of pyproject.toml's list, a data file not matched
    assert not missing, f"missing from the wheel: {sorted(missing)}"


def test_the_installed_wheel_runs_from_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    # No pip in the new environment (seconds saved): this environment's pip installs into it with --python.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env |= {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)]
    _run([*install, "-q"], env, tmp_path)
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env, tmp_path)
    dependencies = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    Path(purelib.stdout.strip(), "_doppler_test_dependencies.pth").write_text("\n".join(dependencies) + "\n")

    work = tmp_path / "elsewhere"  # outside the checkout, so no relative path can reach it
    model = write_tiny_model(work / "tiny")
    env |= {"DOPPLER_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    where = "import json, doppler_py, doppler_py.gpu.kernels as k\n"
    where += "print(json.dumps([doppler_py.__file__, str(k.SHADER_DIR)]))"
    cli = str(venv / "bin" / "doppler-py")
    generate = ["generate", "hello", "--model", str(model), "--max-tokens", "4", "--no-progress", "--json"]
    commands = {
        "where": [str(python), "-c", where],
        "info": [cli, "info", "--json"],
        "generate": [cli, *generate, "--speculative", "none"],  # plain decoding: no draft pipelines to compile
    }
    with ThreadPoolExecutor(len(commands)) as pool:  # info and generate each compile pipelines: side by side
        futures = {name: pool.submit(_run, command, env, work) for name, command in commands.items()}
        runs = {name: future.result() for name, future in futures.items()}

    package_file, shader_dir = (Path(p).resolve() for p in json.loads(runs["where"].stdout))
    assert package_file.is_relative_to(venv.resolve()), f"doppler_py imported from {package_file}, not the wheel"
    assert shader_dir == package_file.parent / "shaders", shader_dir
    assert not shader_dir.is_relative_to(ROOT)
    kernels = json.loads(runs["info"].stdout)["kernels"]
    assert set(kernels) == {p.stem for p in (ROOT / "shaders").glob("*.wgsl")} and all(kernels.values())
    assert 0 < json.loads(runs["generate"].stdout)["completion_tokens"] <= 4

    # The benchmarks are scripts of the source checkout: the installed command says so instead of failing.
    bench = subprocess.run([cli, "bench", "speculative"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert bench.returncode == 1 and "Traceback" not in bench.stderr, bench.stderr
    assert "tools/bench_speculative.py" in bench.stderr and "source" in bench.stderr
