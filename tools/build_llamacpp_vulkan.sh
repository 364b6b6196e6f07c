#!/usr/bin/env bash
# Builds llama-cpp-python with llama.cpp's Vulkan backend on Debian 12, for tools/bench_peers.py's
# llama.cpp-vulkan peer (issue 64), and installs the wheel into the Python that runs the bench.
#
#   tools/build_llamacpp_vulkan.sh [DIR]   DIR defaults to $DOPPLER_LLAMACPP_DIR or ~/.cache/doppler-py/llamacpp
#   PYTHON=.venv/bin/python tools/build_llamacpp_vulkan.sh
#
# Needs: cmake, a C++ compiler, glslc and libvulkan-dev (the loader to link; `apt-get install cmake g++ glslc
# libvulkan-dev`), and network access to PyPI (the sdist, scikit-build-core) and deb.debian.org.
#
# Why not a plain `CMAKE_ARGS=-DGGML_VULKAN=on pip install llama-cpp-python`: Debian 12's Vulkan headers
# (libvulkan-dev 1.3.239) lack VK_EXT_layer_settings (headers >= 1.3.261), and ggml-vulkan.cpp fails with
# "'LayerSettingEXT' is not a member of 'vk'". So the headers come from Debian 13's libvulkan-dev (1.4.309 when this
# was written), fetched with `apt-get download` under a private sources list and unpacked with `dpkg -x` into DIR
# (nothing is installed), and named to CMake by -DVulkan_INCLUDE_DIR; the system's 1.3.239 loader links against
# them. Debian 12's glslc (shaderc 2023.2) lacks the cooperative-matrix, integer-dot and bf16 extensions, so the
# build has only llama.cpp's plain shaders.
#
# The build compiles ~500 files and several hundred shader variants: about 55 minutes on a shared 2-core host.
# The wheel is kept in DIR/wheel (a second run only reinstalls it; delete it to rebuild).
#
# At run time ggml-vulkan ignores a CPU-type device such as lavapipe unless GGML_VK_VISIBLE_DEVICES names it
# ("No devices found" otherwise); tools/bench_peers.py sets GGML_VK_VISIBLE_DEVICES=0 for its Vulkan peer only.
set -euo pipefail
dir="${1:-${DOPPLER_LLAMACPP_DIR:-$HOME/.cache/doppler-py/llamacpp}}"
python="${PYTHON:-python3}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"  # the version issue 64's figures were measured with
headers_suite="${VULKAN_HEADERS_SUITE:-trixie}"

for tool in apt-get dpkg cmake glslc; do
  command -v "$tool" >/dev/null 2>&1 || { echo "build_llamacpp_vulkan: $tool missing (see the header)" >&2; exit 1; }
done
multiarch="$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)"
[ -e "/usr/lib/$multiarch/libvulkan.so" ] || { echo "build_llamacpp_vulkan: no libvulkan.so (apt-get install libvulkan-dev)" >&2; exit 1; }

headers="$dir/vulkan-headers"
if [ ! -f "$headers/usr/include/vulkan/vulkan.hpp" ]; then
  work="$headers.partial"
  rm -rf "$work"
  source "$(dirname "${BASH_SOURCE[0]}")/apt_download.sh"
  apt_download "$work" "$headers_suite" libvulkan-dev
  mkdir "$work/root"
  dpkg -x "$work"/debs/libvulkan-dev_*.deb "$work/root"
  grep -q "LayerSettingEXT" "$work/root/usr/include/vulkan/vulkan.hpp" "$work"/root/usr/include/vulkan/vulkan_*.hpp ||
    { echo "build_llamacpp_vulkan: $headers_suite's Vulkan headers lack VK_EXT_layer_settings too" >&2; exit 1; }
  dpkg-deb -f "$work"/debs/libvulkan-dev_*.deb Version >"$work/root/version"
  rm -rf "$headers"
  mv "$work/root" "$headers"
  rm -rf "$work"
fi
echo "build_llamacpp_vulkan: Vulkan headers $(cat "$headers/version") in $headers"

wheel_dir="$dir/wheel"
if ! ls "$wheel_dir"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
  mkdir -p "$wheel_dir"
  export CMAKE_ARGS="-DGGML_VULKAN=on -DVulkan_INCLUDE_DIR=$headers/usr/include"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  echo "build_llamacpp_vulkan: building llama-cpp-python $version with CMAKE_ARGS=$CMAKE_ARGS (long)"
  "$python" -m pip wheel --no-deps --no-binary llama-cpp-python --no-cache-dir -w "$wheel_dir" \
    "llama-cpp-python==$version"
fi
wheel="$(ls "$wheel_dir"/llama_cpp_python-"$version"-*.whl | head -n 1)"
# Its runtime dependencies (numpy, jinja2, diskcache, typing-extensions) from PyPI as usual, the wheel itself as built.
"$python" -m pip install --force-reinstall --no-deps "$wheel"
"$python" -m pip install "$wheel"
GGML_VK_VISIBLE_DEVICES=0 "$python" -c "import llama_cpp; assert llama_cpp.llama_supports_gpu_offload(), 'built without a GPU backend'"
echo "build_llamacpp_vulkan: installed $wheel (GPU offload: yes; run the bench with GGML_VK_VISIBLE_DEVICES=0 set for it)"
