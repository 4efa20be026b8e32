#!/usr/bin/env bash
# Runs device kernels' logic on the host (one thread per block, see shim.h) against
# references written from the host code. Needs a C++17 compiler; no GPU, no CUDA toolkit.
set -euo pipefail
cd "$(dirname "$0")"
cxx=${CXX:-c++}
if ! command -v "$cxx" >/dev/null; then
  echo "warning: no C++ compiler ($cxx); the kernel harness is skipped" >&2
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$cxx" -std=c++17 -O2 -w -o "$out/sample_rows" sample_rows.cpp
"$out/sample_rows"
"$cxx" -std=c++17 -O2 -w -o "$out/resident" resident.cpp
"$out/resident"
"$cxx" -std=c++17 -O2 -w -o "$out/norms" norms.cpp
"$out/norms"
# Warp-cooperative kernels run with a thread per CUDA thread (simt.h): C++20 for std::barrier.
"$cxx" -std=c++20 -O2 -w -pthread -o "$out/attend_warps" attend_warps.cpp
"$out/attend_warps"
"$cxx" -std=c++20 -O2 -w -pthread -o "$out/gemv" gemv.cpp
"$out/gemv"
"$cxx" -std=c++20 -O2 -w -pthread -o "$out/sketch" sketch.cpp
"$out/sketch"
"$cxx" -std=c++20 -O2 -w -pthread -o "$out/top_blocks" top_blocks.cpp
"$out/top_blocks"
"$cxx" -std=c++20 -O2 -w -pthread -o "$out/place_picks" place_picks.cpp
"$out/place_picks"
