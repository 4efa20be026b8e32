#!/usr/bin/env python3
"""Per-kernel totals of an Nsight Compute CSV (`ncu --csv --metrics ...`), per step.

Reads what `ncu --csv` prints (other lines, such as the profiled program's own output or
ncu's `==PROF==` notes, are skipped) and prints each kernel's launches and microseconds
(`gpu__time_duration.sum`) divided by STEPS, its mean DRAM throughput share and registers
where those metrics were asked for, largest first, then the total. With
`DECODE_NODE_PROFILE_STEPS=B:SKIP:N` and `ncu --profile-from-start off`, STEPS is N: the
figures are one decode step's. ncu runs each kernel alone, so the total is the device's
work a step with no overlap and no gaps, not the step's time.

Usage: scripts/ncu-summary.py CSV [STEPS]
"""
import csv
import sys

TIME = "gpu__time_duration.sum"
DRAM = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
REGS = "launch__registers_per_thread"


def number(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def launches(lines):
    """{launch id: {"kernel": name, metric: value}} from ncu's CSV lines."""
    rows = csv.reader(line for line in lines if line.startswith('"'))
    header = next(rows, None)
    if header is None or "Kernel Name" not in header:
        return {}
    col = {name: i for i, name in enumerate(header)}
    out = {}
    for r in rows:
        if len(r) != len(header):
            continue
        d = out.setdefault(r[col["ID"]], {"kernel": r[col["Kernel Name"]]})
        d[r[col["Metric Name"]]] = number(r[col["Metric Value"]])
    return out


def short(name):
    """A kernel's name without its parameter list (cuBLAS's are long)."""
    return name.split("(")[0].strip()[:70]


def summary(lines, steps=1):
    per = {}
    for d in launches(lines).values():
        k = per.setdefault(short(d["kernel"]), {"n": 0, "ns": 0.0, "dram": [], "regs": None})
        k["n"] += 1
        k["ns"] += d.get(TIME) or 0.0
        if d.get(DRAM) is not None:
            k["dram"].append(d[DRAM])
        if d.get(REGS) is not None:
            k["regs"] = int(d[REGS])
    out = []
    total = sum(k["ns"] for k in per.values())
    for name, k in sorted(per.items(), key=lambda kv: -kv[1]["ns"]):
        dram = f"{sum(k['dram']) / len(k['dram']):5.1f}%" if k["dram"] else "     -"
        regs = f"{k['regs']:4d}" if k["regs"] is not None else "   -"
        share = k["ns"] / total if total else 0.0
        out.append(f"{name:70s} launches/step {k['n'] / steps:7.1f}  us/step {k['ns'] / steps / 1e3:9.1f}"
                   f"  ({share:5.1%})  dram {dram}  regs {regs}")
    out.append(f"{'total':70s} launches/step {sum(k['n'] for k in per.values()) / steps:7.1f}"
               f"  us/step {total / steps / 1e3:9.1f}")
    return out


def main(argv):
    if len(argv) < 2 or len(argv) > 3:
        sys.exit(__doc__)
    steps = int(argv[2]) if len(argv) == 3 else 1
    if steps < 1:
        sys.exit("STEPS must be at least 1")
    with open(argv[1], errors="replace") as f:
        lines = f.read().splitlines()
    for line in summary(lines, steps):
        print(line)


if __name__ == "__main__":
    main(sys.argv)
