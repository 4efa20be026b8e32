#!/usr/bin/env bash
# Everything #21 asks to measure on a GPU, in one go, for a session that is lent one: the
# kernels and end-to-end decodes against the CPU (selftest, float and 8-bit host KV), then
# `bench decode` and `bench capacity` on the Qwen3-14B shape (random bf16 weights, made here).
# Each step's output goes to $OUT (or ./gpu-run) as it finishes, so a run cut short by the
# device's time limit still leaves what it measured.
#
# Usage: scripts/gpu-run.sh [path/to/decode-node] [layers]
#   The binary must be built with `--features cuda`; layers defaults to 10 (of 40).
# Needs: an NVIDIA driver and the CUDA 13 cuBLAS and NVRTC libraries where the loader finds them.
set -euo pipefail
bin=${1:-target/release/decode-node}
layers=${2:-10}
out=${OUT:-gpu-run}
mkdir -p "$out"
model="$out/qwen3-14b-${layers}l"
step() {
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$out/summary.txt"
    local t0=$SECONDS
    if "$@" >"$out/$name.json" 2>"$out/$name.log"; then
        echo "   ok in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
    else
        echo "   FAILED (rc $?) in $((SECONDS - t0)) s; tail of its log:" | tee -a "$out/summary.txt"
        tail -20 "$out/$name.log" | tee -a "$out/summary.txt"
    fi
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1 || true
step selftest "$bin" selftest --device cuda
step selftest-int8 "$bin" selftest --device cuda --kv-dtype int8
# Resident layers (#21) are new and were written without a GPU: where their selftest check did
# not pass (or the selftest died before it), the benches below run with them off, so the rest
# still measures, and the A/B row says so.
if ! grep -q "^PASS decode step, layers resident on the device" "$out/selftest.json" 2>/dev/null; then
    echo "   resident layers did not pass selftest: DECODE_NODE_RESIDENT_LAYERS=0 from here" |
        tee -a "$out/summary.txt"
    export DECODE_NODE_RESIDENT_LAYERS=0
fi
if [[ ! -f "$model/config.json" ]]; then
    step make-model "$bin" make-model --out "$model" --arch qwen3 --preset qwen3-14b \
        --num-layers "$layers" --dtype bf16
fi
step decode-8k-32k "$bin" bench decode --json --device cuda --model "$model" \
    --context 8k,32k --modes full,hgca,recall,scout --budget-tokens 2048 --tokens 64
# The same full rows with every layer driven from the host (resident layers off): the A/B of
# #21's resident path.
step decode-8k-host-layers env DECODE_NODE_RESIDENT_LAYERS=0 "$bin" bench decode --json \
    --device cuda --model "$model" --context 8k --modes full,scout --budget-tokens 2048 \
    --tokens 64
step decode-64k "$bin" bench decode --json --device cuda --model "$model" \
    --context 64k --modes full,scout --budget-tokens 2048 --tokens 64
step decode-8k-batch8 "$bin" bench decode --json --device cuda --model "$model" \
    --context 8k --modes full,scout --batch 8 --tokens 64
step capacity-64k "$bin" bench capacity --json --device cuda --model "$model" \
    --context 64k --modes full,scout --budget-tokens 2048 --tokens 32 \
    --device-kv-bytes 40Gi --host-kv-bytes 96Gi
echo "results in $out/"
