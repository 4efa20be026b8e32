#!/usr/bin/env bash
# Lints what a node exposes on /metrics with Prometheus' own linter (`promtool check metrics`),
# after a push and a generation so every family has samples. Both formats are checked: the
# Prometheus text format, and OpenMetrics (what a scraper asks for first) through promtool's
# parser by way of the text one.
# Usage: scripts/check-metrics.sh [path/to/decode-node]   (needs promtool and curl)
set -euo pipefail
bin=${1:-target/release/decode-node}
log=$(mktemp)
"$bin" --log-format json serve --model tiny --grpc-addr 127.0.0.1:0 --metrics-addr 127.0.0.1:0 2>"$log" &
node=$!
trap 'kill "$node" 2>/dev/null; wait "$node" 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 100); do
  grep -q '"serving"' "$log" && break
  sleep 0.1
done
addr() { grep '"serving"' "$log" | sed -E "s/.*\"$1\":\"([^\"]+)\".*/\1/"; }
grpc=$(addr grpc_addr)
metrics=$(addr metrics_addr)
if [ -z "$grpc" ] || [ -z "$metrics" ]; then
  echo "check-metrics: the node did not start" >&2
  cat "$log" >&2
  exit 1
fi
"$bin" prefill --target "http://$grpc" --prompt "metrics lint" --request-id lint >/dev/null
"$bin" generate --target "http://$grpc" --request-id lint --max-new-tokens 4 >/dev/null
text=$(curl -sf "http://$metrics/metrics")
# A lint finding makes promtool exit non-zero; an empty body would pass, so ask for families.
grep -q '^# TYPE decode_node_' <<<"$text" || { echo "check-metrics: no decode_node_ families" >&2; exit 1; }
promtool check metrics <<<"$text"
open=$(curl -sf -H 'Accept: application/openmetrics-text; version=1.0.0' "http://$metrics/metrics")
tail -n 1 <<<"$open" | grep -qx '# EOF' || { echo "check-metrics: OpenMetrics body without # EOF" >&2; exit 1; }
echo "check-metrics: $(grep -c '^# TYPE' <<<"$text") metric families pass promtool's lint"
