#!/usr/bin/env bash
# Regenerates the gRPC stubs from ../../proto (pinned grpcio-tools in requirements-dev.txt).
set -euo pipefail
cd "$(dirname "$0")"
out="${1:-.}"
# --pyi_out: type stubs of the messages, so editors and type checkers see their fields.
python -m grpc_tools.protoc -I../../proto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  ../../proto/decode_node/v1/*.proto
