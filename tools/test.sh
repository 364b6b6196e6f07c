#!/usr/bin/env bash
# README command 2: install what is missing (including the test-only tools), then run the test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/tools/bootstrap.sh" test
cd "$root"
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
