#!/usr/bin/env bash
# Unpacks Mesa's lavapipe from Debian bookworm-backports (Mesa 25) into a folder, beside the system's Mesa, for
# the Dawn lanes only: Dawn (npm `webgpu`) refuses Debian's Mesa 22.3 lavapipe, and Chrome's SwiftShader has no
# shader-f16, which doppler-gpu's f16-activation and Q4K paths need (tests/parity/test_model_formats.py).
#
#   tools/mesa25.sh [DIR]   DIR defaults to $DOPPLER_MESA25_DIR or ~/.cache/doppler-py/mesa25
#
# Writes DIR/lvp_icd.json (the lvp ICD json with an absolute library_path) and DIR/lib (for LD_LIBRARY_PATH: the
# newer libdrm the driver links against). Nothing is installed: apt runs with a private sources list, state and
# cache under DIR, and `apt-get download` fetches the debs that `dpkg -x` unpacks. Whatever version backports holds
# now is taken (no pinned pool URL). Quick when DIR/lvp_icd.json is there already; delete DIR to refetch.
set -euo pipefail
dir="${1:-${DOPPLER_MESA25_DIR:-$HOME/.cache/doppler-py/mesa25}}"
icd="$dir/lvp_icd.json"
if [ -f "$icd" ]; then
  exit 0
fi
command -v apt-get >/dev/null 2>&1 || { echo "mesa25: apt-get missing (Debian only)" >&2; exit 1; }
work="$dir.partial"
rm -rf "$work"
mkdir -p "$work/root"
source "$(dirname "${BASH_SOURCE[0]}")/apt_download.sh"
# mesa-vulkan-drivers holds libvulkan_lvp.so; it links a newer libdrm (libdrm2, libdrm-amdgpu1) than bookworm's.
apt_download "$work" bookworm-backports mesa-vulkan-drivers libdrm2 libdrm-amdgpu1
for deb in "$work"/debs/*.deb; do
  dpkg -x "$deb" "$work/root"
done
lib="$work/root/usr/lib/$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)"
lvp="$lib/libvulkan_lvp.so"
[ -f "$lvp" ] || { echo "mesa25: no libvulkan_lvp.so in the unpacked debs" >&2; exit 1; }
json="$(ls "$work"/root/usr/share/vulkan/icd.d/lvp_icd*.json | head -n 1)"
# The folder moves to $dir below: the json names the library where it will be.
final_lib="$dir/lib"
sed -E "s#\"library_path\": *\"[^\"]*\"#\"library_path\": \"$final_lib/libvulkan_lvp.so\"#" "$json" >"$work/lvp_icd.json"
mkdir "$work/lib"
mv "$lvp" "$lib"/libdrm*.so.* "$work/lib/"  # the other drivers and layers in the debs are not needed
dpkg-deb -f "$work/debs/"mesa-vulkan-drivers_*.deb Version >"$work/version"
rm -rf "$work/apt" "$work/debs" "$work/root"
rm -rf "$dir"
mv "$work" "$dir"
echo "mesa25: lavapipe $(cat "$dir/version") in $dir"
