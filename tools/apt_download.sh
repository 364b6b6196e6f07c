# Sourced by tools/mesa25.sh and tools/build_llamacpp_vulkan.sh: fetch Debian packages without installing them.
#
#   apt_download WORK SUITE PACKAGE...
#
# Runs apt with a private sources list (deb.debian.org SUITE main), state and cache under WORK/apt, and
# `apt-get download`s the packages' .debs into WORK/debs for `dpkg -x` to unpack. Nothing on the system changes.
apt_download() {
  local work="$1" suite="$2"
  shift 2
  mkdir -p "$work/apt/lists/partial" "$work/apt/archives/partial" "$work/debs"
  echo "deb http://deb.debian.org/debian $suite main" >"$work/apt/sources.list"
  local apt_opts=(
    -o "Dir::Etc::SourceList=$work/apt/sources.list"
    -o "Dir::Etc::SourceParts=-"
    -o "Dir::State::Lists=$work/apt/lists"
    -o "Dir::Cache=$work/apt"
    -o "Dir::State::status=/dev/null"
    -o "APT::Architecture=$(dpkg --print-architecture)"
    -o "Debug::NoLocking=1"
    -o "APT::Get::List-Cleanup=0"
    -o "APT::Sandbox::User=$(id -un)"  # apt's _apt user cannot write into WORK
  )
  apt-get "${apt_opts[@]}" update -qq
  (cd "$work/debs" && apt-get "${apt_opts[@]}" download -qq "$@")
}
