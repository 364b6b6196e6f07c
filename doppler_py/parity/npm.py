"""Fetch a pinned npm package into the cache, verified against its registry integrity, and unpack it once.

The JS original (doppler-gpu) is never committed to this repository: parity tests and tools fetch it with
`npm pack`, check the tarball's sha512 against the integrity pinned here, and reuse the unpacked copy on later
runs (the tarball is re-verified every time). A tarball that does not match is an error, never a skip.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from doppler_py.errors import DopplerError
from doppler_py.paths import cache_dir

NPM_TIMEOUT_S = 180


@dataclass(frozen=True)
class NpmPackage:
    name: str
    version: str
    integrity: str  # as the registry states it: "sha512-" + base64 of the tarball's SHA-512

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def stem(self) -> str:
        # How `npm pack` names the tarball: "@scope/name" becomes "scope-name".
        return f"{self.name.removeprefix('@').replace('/', '-')}-{self.version}"


DOPPLER_GPU = NpmPackage(
    "doppler-gpu",
    "0.5.1",
    "sha512-eVzxMdaRn5QN3z1lUQB3BSfSN+MNwB9uMMSAMa0MsAVGLUvy9vyj48jYqR2HfadXmmAsHpdMLXFYmNydjtjJrw==",
)


class NpmUnavailableError(DopplerError):
    """npm is missing, or the registry could not be reached, so the package cannot be fetched."""


class NpmIntegrityError(DopplerError):
    """A fetched tarball's bytes do not match the pinned integrity."""


def integrity_of(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode("ascii")


def fetch_package(package: NpmPackage = DOPPLER_GPU, cache: Path | None = None) -> Path:
    """The unpacked package folder (the one holding its package.json), fetched and verified on first use."""
    root = cache if cache is not None else cache_dir("npm")
    tarball = root / f"{package.stem}.tgz"
    if not tarball.exists() or integrity_of(tarball) != package.integrity:
        _download(package, tarball)
    unpacked = root / package.stem
    marker = unpacked / ".integrity"
    if not (marker.exists() and marker.read_text() == package.integrity):
        _unpack(tarball, unpacked, package.integrity)
    return unpacked / "package"


def _download(package: NpmPackage, tarball: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise NpmUnavailableError(f"npm is not installed, so {package.spec} cannot be fetched")
    with tempfile.TemporaryDirectory(dir=tarball.parent, prefix=".pack-") as scratch:
        # Few, short retries: an offline machine should learn it is offline in seconds, not minutes.
        retries = ["--fetch-retries=1", "--fetch-retry-mintimeout=1000", "--fetch-retry-maxtimeout=10000"]
        command = [npm, "pack", package.spec, "--pack-destination", scratch, "--prefer-offline", "--ignore-scripts"]
        command += retries
        try:
            done = subprocess.run(command, cwd=scratch, capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise NpmUnavailableError(f"`npm pack {package.spec}` took over {NPM_TIMEOUT_S} s") from exc
        fetched = Path(scratch) / tarball.name
        if done.returncode != 0 or not fetched.exists():
            detail = (done.stderr or done.stdout).strip().splitlines()[:4]  # npm's error code and message
            raise NpmUnavailableError(f"`npm pack {package.spec}` failed: {' / '.join(detail)}")
        found = integrity_of(fetched)
        if found != package.integrity:
            raise NpmIntegrityError(f"{package.spec} tarball has integrity {found}, expected {package.integrity}")
        # Atomic, so a concurrent run sees either no tarball or a complete one.
        os.replace(fetched, tarball)


def _unpack(tarball: Path, unpacked: Path, integrity: str) -> None:
    # The tarball was verified just before, but a concurrent fetch may have replaced it: check what we unpack.
    found = integrity_of(tarball)
    if found != integrity:
        raise NpmIntegrityError(f"{tarball} has integrity {found}, expected {integrity}")
    scratch = Path(tempfile.mkdtemp(dir=unpacked.parent, prefix=".unpack-"))
    scratch.chmod(0o755)  # mkdtemp makes it private; the unpacked copy is meant to be shared
    try:
        with tarfile.open(tarball) as archive:
            archive.extractall(scratch, filter="data")
        (scratch / ".integrity").write_text(integrity)
        if (unpacked / ".integrity").exists():
            return  # another process finished first; leave its copy alone (it may be in use)
        shutil.rmtree(unpacked, ignore_errors=True)  # an incomplete copy left by an interrupted run
        try:
            os.replace(scratch, unpacked)
        except OSError:
            # Another process unpacked it first; a copy only ever appears whole, marker included.
            if not (unpacked / ".integrity").exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
