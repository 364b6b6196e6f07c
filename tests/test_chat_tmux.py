"""`doppler-py chat` in a real terminal: tmux runs it in a pseudo-terminal, send-keys types, capture-pane reads
the screen. Checks what a person sees: a streamed answer, history across turns, Ctrl-C stopping an answer and
giving the prompt back, /reset and /exit. Skipped where tmux is missing, except under CI=true."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from doppler_py.testing.tiny import TinySpec

pytestmark = pytest.mark.slow  # a `chat` process in a terminal: seconds each

STATS = re.compile(r"^\[(\d+) tokens \(prompt (\d+)\)", re.M)
PROMPT_LINE = re.compile(r"^>( .*)?$", re.M)  # a prompt, empty or with what was typed after it

if shutil.which("tmux") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("tmux is missing in CI (tools/bootstrap.sh test installs it)", pytrace=False)
    pytest.skip("tmux is not installed", allow_module_level=True)


class Terminal:
    """One tmux server (its own socket) running one command in a 200x50 window.

    The command's exit status goes to a file: tmux 3.3a sometimes leaves the exited command a zombie it never
    reaps, so `pane_dead_status` stays empty although the command has exited."""

    def __init__(self, command: list[str], env: dict[str, str], status_file: Path):
        self.socket = f"doppler-test-{uuid.uuid4().hex[:8]}"
        self.status_file = status_file
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        # `trap :` keeps the shell alive through the Ctrl-C the tests type (a handler, not an ignored signal, so the
        # command itself still receives SIGINT with its default disposition).
        script = f"trap : INT; {shlex.join(command)}; echo $? > {shlex.quote(str(status_file))}"
        line = f"env {exports} sh -c {shlex.quote(script)}"
        self.tmux("new-session", "-d", "-s", "t", "-x", "200", "-y", "50", line)
        self.tmux("set-option", "-t", "t", "remain-on-exit", "on")
        self.tmux("set-option", "-t", "t", "history-limit", "10000")

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "t")

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "t", "-l", text)
        self.tmux("send-keys", "-t", "t", "Enter")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def wait_for(self, condition, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if condition(screen):
                return screen
            assert time.monotonic() < deadline, f"timed out; the screen:\n{screen}"
            time.sleep(0.1)

    def wait_for_exit(self, status: int, timeout: float = 30) -> None:
        """Wait until the command has exited with `status`."""
        self.wait_for(lambda _: self.status_file.is_file() and self.status_file.read_text().strip() != "", timeout)
        assert self.status_file.read_text().strip() == str(status), self.screen()

    def pane(self, fmt: str) -> str:
        return self.tmux("display-message", "-p", "-t", "t", fmt).strip()

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def chat(tiny_folder, tmp_path):
    folder = tiny_folder(TinySpec(max_position_embeddings=4096))
    terminals = []

    def start(*options: str) -> Terminal:
        command = [sys.executable, "-m", "doppler_py.cli", "chat", "--model", str(folder), "--no-progress", *options]
        env = {"XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp"), "DOPPLER_CACHE": str(tmp_path)}
        terminals.append(Terminal(command, env, tmp_path / f"status-{len(terminals)}"))
        return terminals[-1]

    yield start
    for terminal in terminals:
        terminal.close()


def prompts(screen: str) -> int:
    """How many prompts were shown; only counted once the last one waits for input (an empty prompt line)."""
    lines = screen.rstrip("\n").splitlines()
    waiting = bool(lines) and lines[-1].rstrip() == ">"
    return len(PROMPT_LINE.findall(screen)) if waiting else -1


def test_chat_in_a_terminal_keeps_history_resets_and_exits(chat):
    term = chat("--max-tokens", "6", "--speculative", "none")
    term.wait_for(lambda s: "/reset starts over" in s and prompts(s) == 1)
    term.type("Hello there")
    term.wait_for(lambda s: len(STATS.findall(s)) == 1 and prompts(s) == 2)
    term.type("And again")
    term.wait_for(lambda s: len(STATS.findall(s)) == 2 and prompts(s) == 3)
    term.type("/reset")
    term.wait_for(lambda s: "(conversation reset)" in s and prompts(s) == 4)
    term.type("Hello there")
    screen = term.wait_for(lambda s: len(STATS.findall(s)) == 3 and prompts(s) == 5)
    (n1, p1), (_, p2), (_, p3) = ((int(a), int(b)) for a, b in STATS.findall(screen))
    assert p2 > p1 + n1  # the second turn carries the first exchange
    assert p3 == p1  # after /reset the conversation starts afresh
    term.type("/exit")
    term.wait_for_exit(0)


def test_ctrl_c_stops_a_streaming_answer_and_returns_to_the_prompt(chat):
    term = chat("--max-tokens", "3000", "--max-seq", "4096", "--speculative", "none")
    term.wait_for(lambda s: prompts(s) == 1)
    term.type("Tell me a story.")
    # Streaming: text shows up while the answer is still being generated (no stats line yet).
    before = term.wait_for(lambda s: len(s.split("Tell me a story.", 1)[1].strip()) > 40 and not STATS.search(s))
    term.keys("C-c")
    screen = term.wait_for(lambda s: "(cancelled)" in s and prompts(s) == 2, timeout=30)
    assert not STATS.search(screen) and len(screen) >= len(before.rstrip())
    # The session goes on: the next answer streams (and can be stopped too), then /reset and /exit work.
    term.type("Once more.")
    term.wait_for(lambda s: len(s.split("Once more.", 1)[1].strip()) > 20)
    term.keys("C-c")
    term.wait_for(lambda s: s.count("(cancelled)") == 2 and prompts(s) == 3, timeout=30)
    term.type("/reset")
    term.wait_for(lambda s: "(conversation reset)" in s and prompts(s) == 4, timeout=30)
    term.type("/exit")
    term.wait_for_exit(0)
