#!/usr/bin/env bash
# The CPU model executor against llama.cpp on the same machine, in the same minutes (#20): an
# outside reference for `bench decode --device cpu`, whose ratio to the VM's read bandwidth moves
# with the bandwidth probe. SmolLM2-135M with bf16 weights on both sides (our loader dequantizes
# the Q4_1 GGUF to bf16; llama-quantize makes the same bf16 GGUF for llama.cpp), full attention,
# batch 1, at context 128 (llama-bench's depth 0) and 4096, alternating ROUNDS times.
#
#   scripts/llama-cpp-side-by-side.sh [BIN] [ROUNDS]     (BIN: target/release/decode-node)
#
# Fetches llama.cpp as it ships inside the `llama-cpp-python` sdist from PyPI (pinned below) once
# into target/llama-cpp and builds llama-bench and llama-quantize there (cmake and a C++
# compiler; a few minutes on 2 cores). Nothing of it is committed or linked. THREADS (2) sets
# both sides' threads; LLAMA_NATIVE=OFF builds llama.cpp for AVX2 + FMA + F16C only (compare
# with DECODE_NODE_AVX512=0).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:-$root/target/release/decode-node}"
rounds="${2:-2}"
threads="${THREADS:-2}"
version=0.3.36
cache="${DECODE_NODE_CACHE:-$root/target}/llama-cpp"
native="${LLAMA_NATIVE:-ON}"
build="$cache/build-native-$native"

command -v cmake > /dev/null || { echo "needs cmake (apt-get install cmake)" >&2; exit 2; }
[[ -x "$bin" ]] || { echo "no decode-node binary at $bin (cargo build --release -p decode-node)" >&2; exit 2; }

src="$cache/llama_cpp_python-$version/vendor/llama.cpp"
if [[ ! -d "$src" ]]; then
    mkdir -p "$cache"
    python3 -m pip download --quiet --no-deps --no-binary :all: --dest "$cache" \
        "llama-cpp-python==$version" >&2
    tar -xzf "$cache/llama_cpp_python-$version.tar.gz" -C "$cache"
fi
if [[ ! -x "$build/bin/llama-bench" ]]; then
    # Without the native build, exactly the CI class's instruction sets.
    isa=()
    [[ "$native" == ON ]] || isa=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE="$native" ${isa[@]+"${isa[@]}"} \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF > "$cache/cmake.log" 2>&1
    cmake --build "$build" -j "$(nproc)" --target llama-bench llama-quantize \
        > "$cache/build.log" 2>&1 || { tail -20 "$cache/build.log" >&2; exit 1; }
fi

q41="$("$root/scripts/fetch-smollm2.sh")"
bf16="$cache/SmolLM2-135M-Instruct.bf16.gguf"
if [[ ! -f "$bf16" ]]; then
    "$build/bin/llama-quantize" --allow-requantize "$q41" "$bf16" BF16 > "$cache/quantize.log" 2>&1
fi

echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $threads threads; AVX512 ${DECODE_NODE_AVX512:-default}, llama.cpp native $native"
for r in $(seq 1 "$rounds"); do
    echo "== round $r"
    "$build/bin/llama-bench" -m "$bf16" -p 0 -n 64 -t "$threads" -d 0,4096 -r 3 2>/dev/null \
        | awk -F'|' '/tg64/ { t = $(NF-2); r = $(NF-1); gsub(/^ +| +$/, "", t); gsub(/^ +| +$/, "", r)
                               print "llama.cpp " t ": " r " tok/s" }'
    "$bin" bench decode --model "$q41" --modes full --context 128,4096 --tokens 64 --rounds 3 \
        --cpu-attention-threads "$threads" 2>&1 > /dev/null \
        | grep -E "^decode ctx=[0-9]+ +full: +[0-9.]+ tok/s|^decode ctx=[0-9]+ +full: [0-9.]+ MB moved" \
        | sed 's/^/decode-node /'
done
