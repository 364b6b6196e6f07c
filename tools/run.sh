#!/usr/bin/env bash
# README command 1: install what is missing, then run the main job — SmolLM2-135M-Instruct generating with
# speculative decoding ("auto"), streaming the text and ending with a stats line. Arguments replace the
# default command line, e.g. `bash tools/run.sh chat --weights q4_1`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/tools/bootstrap.sh" main
if [ "$#" -eq 0 ]; then
  set -- generate --speculative auto
fi
exec "$root/.venv/bin/doppler-py" "$@"
