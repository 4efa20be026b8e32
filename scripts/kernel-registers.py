#!/usr/bin/env python3
"""Registers, spills and shared memory of each device kernel, without a GPU.

Compiles attention/src/cuda/kernels.cu with NVRTC (as the node does, for compute_XY), then
assembles the PTX with ptxas for sm_XY and prints what `ptxas -v` says of each entry. A
kernel's registers decide how many of its CUDA blocks an SM holds: `attend_warps_g5_d128` at
255 a thread holds two (8 warps), which ncu on an H200 saw as 12% of warps active. Use it to
check a compile-time tunable (`DECODE_NODE_KERNEL_DEFINES`) before spending device time on it.

Usage: scripts/kernel-registers.py [--arch 90] [--only REGEX] [NAME=VALUE ...]
Needs NVRTC and ptxas of CUDA 13, from pip (no toolkit):
  python3 -m pip install --target target/ci-nvrtc "nvidia-cuda-nvrtc>=13,<14"
  python3 -m pip install --target target/ci-nvcc "nvidia-cuda-nvcc>=13,<14"
or where NVRTC_LIB (libnvrtc.so path) and PTXAS say.
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nvrtc_ptx(lib, src, options):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernels.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    if rc != 0:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(f"NVRTC failed ({rc}):\n{log.value.decode(errors='replace')}")
    n = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90", help="compute capability without the dot (90: H100/H200)")
    ap.add_argument("--only", default="", help="a regex the entry names must match")
    ap.add_argument("defines", nargs="*", help="NAME=VALUE tunables, as DECODE_NODE_KERNEL_DEFINES")
    args = ap.parse_args()
    for d in args.defines:
        if not re.fullmatch(r"[A-Z][A-Z0-9_]*=-?[0-9]+", d):
            sys.exit(f"{d!r} is not NAME=integer")
    nvrtc = os.environ.get("NVRTC_LIB", os.path.join(ROOT, "target/ci-nvrtc/nvidia/cu13/lib/libnvrtc.so.13"))
    ptxas = os.environ.get("PTXAS", os.path.join(ROOT, "target/ci-nvcc/nvidia/cu13/bin/ptxas"))
    for path, what in ((nvrtc, "NVRTC_LIB"), (ptxas, "PTXAS")):
        if not os.path.exists(path):
            sys.exit(f"{path} not found: install it as this script's docstring says, or set {what}")
    lib = ctypes.CDLL(nvrtc)
    with open(os.path.join(ROOT, "attention/src/cuda/kernels.cu"), "rb") as f:
        src = f.read()
    ptx = nvrtc_ptx(lib, src, [f"--gpu-architecture=compute_{args.arch}"] + [f"-D{d}" for d in args.defines])
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "k.ptx")
        with open(p, "wb") as f:
            f.write(ptx)
        out = subprocess.run(
            [ptxas, f"-arch=sm_{args.arch}", "-v", p, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True,
        )
    if out.returncode != 0:
        sys.exit(out.stderr)
    only = re.compile(args.only)
    entry = None
    spills = ""
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            entry, spills = m.group(1), ""
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spills = f"spills {m.group(1)}/{m.group(2)} B"
            continue
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if m and entry and only.search(entry):
            print(f"{entry:40s} {int(m.group(1)):4d} registers  {spills:22s} {m.group(2)} B shared")
            entry = None


if __name__ == "__main__":
    main()
