#!/usr/bin/env bash
# README command 1: install what is missing, then run the main job.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/tools/bootstrap.sh" main
exec "$root/.venv/bin/doppler-py" "${@:-selfcheck}"
