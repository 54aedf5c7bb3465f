#!/bin/bash
# Compiles every csrc/*.cpp for other platforms than this one (Linux aarch64, e.g. a GH200's
# Grace CPU; macOS arm64 and x86_64; Linux x86_64 with clang instead of GCC), with zig's clang
# as the cross compiler and this checkout's torch headers, so a kernel that uses an x86-only
# intrinsic or attribute outside its `#if defined(__x86_64__)` guard, or a GCC-only construct,
# fails here rather than in a user's `pip install`. It compiles (-c, object code), it does not
# link or run: torch's headers are the same on every platform, its libraries are not. -O1, not
# setup.py's -O3: the same front end and instruction selection, in a quarter of the time (-O3,
# 4 targets x 16 files: 17 min on 2 cores).
#
#   python3 -m venv /tmp/zig && /tmp/zig/bin/pip install ziglang
#   bash tools/cross_compile_check.sh /tmp/zig/bin/python [TARGET ...]
#
# Exit status 0 when every file compiles for every target without a warning.
set -u
zigpy=${1:?usage: tools/cross_compile_check.sh PYTHON_WITH_ZIGLANG [TARGET ...]}
shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(aarch64-linux-gnu aarch64-macos x86_64-macos x86_64-linux-gnu)
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
tinc=$("$py" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))") || exit 2
pyinc=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# torch's ATen/ParallelOpenMP.h includes omp.h under -fopenmp, and zig ships none: take GCC's (its
# declarations are the same on every platform), alone in a folder of its own
omp=$(ls /usr/lib/gcc/*/*/include/omp.h 2>/dev/null | head -1)
mkdir "$work/omp" && { [ -z "$omp" ] || cp "$omp" "$work/omp/"; }
echo "zig $("$zigpy" -m ziglang version), torch $("$py" -c 'import torch; print(torch.__version__)') headers"
status=0
for target in "${targets[@]}"; do
  # setup.py's host flags for the target's platform (host_flags: Apple clang has no -fopenmp), at -O1
  case $target in *macos*) platform=darwin ;; *) platform=linux ;; esac
  read -ra flags < <(python3 "$root/setup.py" --print-host-flags "$platform")
  [ ${#flags[@]} -gt 0 ] || { echo "setup.py --print-host-flags $platform printed nothing"; exit 2; }
  flags=("${flags[@]/#-O3/-O1}" -isystem "$work/omp")
  failed=0
  for src in "$root"/csrc/*.cpp; do
    if ! "$zigpy" -m ziglang c++ -target "$target" -c -std=c++20 -fPIC -Wall "${flags[@]}" \
        -I"$tinc" -I"$tinc/torch/csrc/api/include" -I"$pyinc" '-DSWIFTKERN_CXX_FLAGS="check"' \
        -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C "$src" -o "$work/out.o" 2> "$work/err" \
        || grep -q "warning:" "$work/err"; then
      echo "FAIL $target ${src#$root/}"; grep -m5 -E "error|warning" "$work/err"; failed=$((failed + 1)); status=1
    fi
  done
  echo "$target: $(ls "$root"/csrc/*.cpp | wc -l) files, $failed failed"
done
exit $status
