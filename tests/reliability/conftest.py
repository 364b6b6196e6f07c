"""Fixtures of the reliability tests (helpers live in `support.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from reliability.helpers import REPORT_KEY, TINY

from doppler_py.testing.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), TINY)
    assert (folder / "tokenizer.json").is_file(), "write_tiny_model no longer writes a tokenizer"
    return folder


def pytest_terminal_summary(terminalreporter, config) -> None:
    lines = config.stash.get(REPORT_KEY, [])
    if lines:
        terminalreporter.section("reliability numbers")
        for line in lines:
            terminalreporter.write_line(line)
