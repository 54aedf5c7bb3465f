#!/bin/bash
# Syntax-checks every csrc/*.cpp against another torch's headers, with the CPU build's flags and
# with the CUDA build's (-DSWIFTKERN_WITH_CUDA, CUDA's headers), without building or importing
# that torch: so a C++ change that needs a newer torch than the GPU machine's (2.11.0+cu130)
# shows here rather than in a GPU session's build.
#
#   pip download torch==2.11.0 --no-deps -d /tmp/t211
#   bash tools/check_torch_headers.sh /tmp/t211/torch-2.11.0-*.whl
#
# Exit status 0 when every file passes both ways; the compiler's first lines for each that fails.
set -u
wheel=${1:?usage: tools/check_torch_headers.sh TORCH_WHEEL [CUDA_INCLUDE_DIR]}
cuda_include=${2:-/usr/local/cuda/include}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unzip -q "$wheel" 'torch/include/*' 'torch/version.py' -d "$work"
inc=$work/torch/include
# the flags setup.py compiles with (host_flags), plus what torch's CppExtension adds (-std, -fPIC)
read -ra hostflags < <(python3 "$root/setup.py" --print-host-flags)
[ ${#hostflags[@]} -gt 0 ] || { echo "setup.py --print-host-flags printed nothing"; exit 2; }
echo "host flags (setup.py --print-host-flags): ${hostflags[*]}"
pyinc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
echo "torch $(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$work/torch/version.py") headers"
status=0
for build in cpu cuda; do
  extra=()
  if [ "$build" = cuda ]; then
    if [ ! -f "$cuda_include/cuda_runtime.h" ]; then echo "no CUDA headers in $cuda_include: cuda build not checked"; continue; fi
    extra=(-DSWIFTKERN_WITH_CUDA "-I$cuda_include")
  fi
  failed=0
  for src in "$root"/csrc/*.cpp; do
    if ! c++ -fsyntax-only -Wall -fPIC -std=c++20 "${hostflags[@]}" \
        -I"$inc" -I"$inc/torch/csrc/api/include" -I"$pyinc" '-DSWIFTKERN_CXX_FLAGS="check"' \
        -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C "${extra[@]}" "$src" 2> "$work/err"; then
      echo "FAIL ($build) ${src#$root/}"; head -5 "$work/err"; failed=$((failed + 1)); status=1
    fi
  done
  echo "$build build: $(ls "$root"/csrc/*.cpp | wc -l) files, $failed failed"
done
exit $status
