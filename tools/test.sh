#!/usr/bin/env bash
# README command 2: install what is missing (including the test-only tools), then run the test suite.
#   bash tools/test.sh            everything: lint, the suite, then the kernel tests again replayed under Dawn
#   bash tools/test.sh ARGS...    only `pytest ARGS...` (e.g. tests/kernels -k matmul)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/tools/bootstrap.sh" test
cd "$root"
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest --durations=30  # the slowest tests, for whoever next trims CI time
# Browser lane: every kernel test's submits also run under Dawn/Tint (Chrome's WebGPU) on SwiftShader and
# must match wgpu-py (tests/parity/dawn).
DOPPLER_DAWN_REPLAY=1 .venv/bin/python -m pytest -q tests/kernels
