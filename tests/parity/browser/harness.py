"""Headless Chromium running a page of ours against a loopback HTTP server that also receives its results.

`PageServer` serves the page's files (this folder's, and the Dawn lane's job runner it imports) and one JSON
job from memory on 127.0.0.1 (a free port) and takes the page's answer as a POST to /result. `run_page`
starts Debian's Chromium on the page with a new temporary profile, waits for the answer, and ends the browser
(its whole process group).

Chromium flags (Chromium 156, Debian bookworm, no GPU; probed here):
* --headless=new --no-sandbox: no display; the sandbox cannot start as root.
* --enable-unsafe-webgpu: REQUIRED. Without it `requestAdapter()` answers null here, because the only
  adapter is SwiftShader, which Chrome blocklists for WebGPU by default.
* --use-webgpu-adapter=swiftshader: pins Chrome's CPU Vulkan driver (SwiftShader), so a machine with a GPU
  runs the same adapter as CI. Chrome picks it here anyway.
* not needed, tried: --enable-unsafe-swiftshader (gates SwiftShader for WebGL, not WebGPU, in this version)
  and --disable-gpu (does not turn WebGPU off, and does not help it either).
* --no-first-run --disable-background-networking --disable-component-update --disable-sync --disable-quic:
  no traffic beyond loopback (the machine's closed network refuses it, and noisily).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PAGE_DIR = Path(__file__).resolve().parent
CHROMIUM = os.environ.get("DOPPLER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--enable-unsafe-webgpu",
    "--use-webgpu-adapter=swiftshader",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
)
# URL path -> (file, content type). run_job.mjs is the Dawn worker's job runner, which the page imports.
_PAGE_FILES = {
    "/layer.html": (PAGE_DIR / "layer.html", "text/html"),
    "/layer.js": (PAGE_DIR / "layer.js", "text/javascript"),
    "/run_job.mjs": (PAGE_DIR.parent / "dawn" / "run_job.mjs", "text/javascript"),
}


class ChromiumUnavailable(RuntimeError):
    """Chromium is not installed; the message says how to install it."""


class PageError(RuntimeError):
    """The page did not answer in time, or Chromium exited first."""


def find_chromium() -> str:
    path = shutil.which(CHROMIUM)
    if path is None:
        raise ChromiumUnavailable(f"{CHROMIUM} not found (Debian: apt-get install chromium)")
    return path


class PageServer:
    """The page's files, `job` as /job.json, and /result for the page's answer, on 127.0.0.1."""

    def __init__(self, job: dict):
        self.job_bytes = json.dumps(job, separators=(",", ":")).encode()
        self.results: queue.Queue[dict] = queue.Queue()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/job.json":
                    self._send(server.job_bytes, "application/json")
                elif self.path in _PAGE_FILES:
                    path, content_type = _PAGE_FILES[self.path]
                    self._send(path.read_bytes(), content_type)
                else:
                    self.send_error(HTTPStatus.NOT_FOUND)

            def do_POST(self) -> None:
                if self.path != "/result":
                    self.send_error(HTTPStatus.NOT_FOUND)
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    server.results.put(json.loads(body))
                except json.JSONDecodeError as exc:
                    server.results.put({"ok": False, "errors": [f"unreadable result: {exc}"]})
                self.send_response(HTTPStatus.NO_CONTENT)
                self.end_headers()

            def _send(self, body: bytes, content_type: str) -> None:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:
                pass  # requests are not news; failures reach the test through the page's result

        return Handler

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/layer.html"

    def __enter__(self) -> PageServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@dataclass(frozen=True)
class PageRun:
    result: dict  # what the page POSTed
    seconds: float  # from starting Chromium to the page's answer


def run_page(job: dict, timeout_s: float = 60.0) -> PageRun:
    """Serve `job` to layer.html in headless Chromium and return what the page posts back."""
    chromium = find_chromium()
    with PageServer(job) as server, tempfile.TemporaryDirectory(prefix="doppler-chromium-") as profile:
        log_path = Path(profile) / "chromium.log"
        started = time.perf_counter()
        with log_path.open("wb") as log:
            # Its own process group, so ending it also ends the renderer and GPU processes it started.
            browser = subprocess.Popen(
                [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}/data", server.url],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                result = _wait_for_result(server, browser, timeout_s)
                seconds = time.perf_counter() - started
            except PageError as exc:
                raise PageError(f"{exc}\nChromium's log ends with:\n{_tail(log_path)}") from None
            finally:
                _end(browser)
    return PageRun(result, seconds)


def _wait_for_result(server: PageServer, browser: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return server.results.get(timeout=0.2)
        except queue.Empty:
            if browser.poll() is not None:
                raise PageError(f"Chromium exited with code {browser.returncode} before the page answered") from None
    raise PageError(f"the page did not answer within {timeout_s:.0f} s")


def _end(browser: subprocess.Popen) -> None:
    """SIGTERM to the browser's process group, then SIGKILL to whatever of the group is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(browser.pid, sig)
        except ProcessLookupError:
            return  # the whole group is gone
        with contextlib.suppress(subprocess.TimeoutExpired):
            browser.wait(timeout=5.0)


def _tail(path: Path, lines: int = 30) -> str:
    # D-Bus complaints fill the log on a machine without a bus; they say nothing about the page.
    text = [line for line in path.read_text(errors="replace").splitlines() if "dbus" not in line]
    return "\n".join(text[-lines:])
