#!/usr/bin/env python3
"""Medians of the engine's per-step figures in decode logs, per file and batch size.

The engine logs one debug line per decode step (`decode_node::engine::step=debug`): the step's
seconds, the model's, and the attention's phases (plan, the device's scores, the host's
selection, the queuing of the device's scoring, the CPU part and the waits for it). This prints
their medians in milliseconds (counts as they are) per log and batch size, the first tenth of each batch size's
steps skipped (fills, first-call timings). It reads what `scripts/gpu-run.sh` leaves
(`gpu-run/*.log`) or any log of `RUST_LOG=info,decode_node::engine::step=debug decode-node ...`.

Usage: scripts/step-log-summary.py LOG [LOG ...]
"""
import re
import statistics
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r"(\w+)=([-+0-9.eE]+)\b")
# Printed in this order where present; any other numeric field follows.
ORDER = ["step_s", "model_s", "projections_s", "attn_plan_s", "attn_queue_scores_s",
         "attn_scores_s", "attn_select_s", "attn_device_s", "attn_cpu_wait_s", "attn_cpu_s",
         "attn_cpu_start_s", "attn_finish_s", "attn_ahead_s"]


def steps(path):
    """(batch, {field: seconds}) for each step line of `path`."""
    with open(path, errors="replace") as f:
        for line in f:
            line = ANSI.sub("", line)
            if "engine::step" not in line or " step " not in line:
                continue
            fields = {k: float(v) for k, v in FIELD.findall(line)}
            if "step_s" in fields and "batch" in fields:
                yield int(fields.pop("batch")), fields


def summary(path):
    by_batch = {}
    for batch, fields in steps(path):
        by_batch.setdefault(batch, []).append(fields)
    for batch, rows in sorted(by_batch.items()):
        rows = rows[len(rows) // 10:]
        names = [n for n in ORDER if n in rows[0]] + sorted(set(rows[0]) - set(ORDER))
        # Seconds (`_s`) in milliseconds; counts (the layers planned on the device) as they are.
        scale = {n: 1e3 if n.endswith("_s") else 1.0 for n in names}
        medians = {n: statistics.median(r.get(n, 0.0) for r in rows) * scale[n] for n in names}
        cells = "  ".join(f"{n.removesuffix('_s')} {v:.3f}" for n, v in medians.items())
        print(f"{path}  batch {batch}  steps {len(rows)}  (ms, medians)  {cells}")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        summary(path)


if __name__ == "__main__":
    main()
