#!/usr/bin/env bash
# Everything #21 asks to measure on a GPU, in one go, for a session that is lent one: the
# kernels and end-to-end decodes against the CPU (selftest, float and 8-bit host KV), then
# `bench decode` and `bench capacity` on the Qwen3-14B shape (random bf16 weights, made here).
# Each step's output goes to $OUT (or ./gpu-run) as it finishes, so a run cut short by the
# device's time limit still leaves what it measured.
#
# Usage: scripts/gpu-run.sh [path/to/decode-node] [layers]
#   The binary must be built with `--features cuda`; layers defaults to 10 (of 40).
#   STEP_TIMEOUT (seconds, default 180) bounds each step, so one hang cannot spend a lease.
#   SKIP (step names, space-separated) leaves steps out, to fit a short lease.
#   SET=core runs only #21's headline rows (selftest, the model, the kernel and dense-step
#   A/Bs, decode at 8k-64k and batch 8, capacity: 302 s on an H200, 2026-11-29, before the two
#   device-kernels-*-prefetch rows, about 25 s each, and scout-lent, about 50 s, were
#   added); SET=fresh the paths written without a GPU and off by default (device planning,
#   CPU flag, CUDA graphs, copy-engine recall: a selftest and an A/B row each, about 400 s
#   estimated); SET=rest every other step (the model made again where the machine is fresh).
#   A 15-minute lease fits core and fresh as two calls, the second while the machine is still
#   warm (it waits 30 s); rest needs another lease.
# Needs: an NVIDIA driver and the CUDA 13 cuBLAS and NVRTC libraries where the loader finds them.
#   On the lent H100/H200 machines: LD_LIBRARY_PATH=/usr/local/nvidia/lib64:
#   /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/cuda/targets/
#   x86_64-linux/lib (never a `stubs` folder: its libcuda answers CUDA_ERROR_STUB_LIBRARY).
#   Carry a stripped binary (`strip -o dist/decode-node target/release/decode-node`: 16 MB,
#   the unstripped one is over the 64 MiB a call may carry). The whole run took 6 minutes on
#   an H200 (2026-11-26), capacity the longest step (2 minutes); with SKIP="selftest-int8
#   host-kernels host-select dense-step-b4-gemv dense-step-b4-cublas decode-full-split-kernel
#   scout-64k-sketch-f32 scout-32k-predicted-device scout-32k-quest decode-32k-block16 decode-8k-host-layers",
#   5 minutes (2026-11-27). (dense-step-b4-* became dense-step-b8-{cublas,gemv,tc}.) On 2026-11-28 (H200) selftest took 45 s, make-model 18, a
#   `bench decode` of one mode and context about 10, and capacity over 100 (cut there: give
#   it STEP_TIMEOUT=200); the lease's start about 30. On 2026-11-29 (H200, a 15-minute lease)
#   selftest, make-model, the three device-kernels rows, the four dense-step rows, decode-8k-32k,
#   decode-64k, decode-8k-batch8 and capacity-64k (81 s) took 302 s in one call (the rest in
#   SKIP); most others (not host-kernels, host-select, dense-step-b8-tc-chunks8,
#   decode-head-budgets, decode-full-split-kernel, scout-32k-*, the SMOLLM2 ones) in two more
#   calls while warm, 372 s; the three ncu steps then 49 s.
set -euo pipefail
bin=${1:-target/release/decode-node}
layers=${2:-10}
out=${OUT:-gpu-run}
step_timeout=${STEP_TIMEOUT:-180}
mkdir -p "$out"
# Outside $out: the device tool brings back only so many files, and the model's are not wanted.
model="${MODEL_DIR:-/tmp}/qwen3-14b-${layers}l"
core=$(echo selftest make-model device-kernels device-kernels-warps device-kernels-tc \
    device-kernels-warps-prefetch device-kernels-tc-prefetch dense-step \
    dense-step-b8-cublas dense-step-b8-gemv dense-step-b8-tc decode-8k-32k decode-64k \
    decode-8k-batch8 capacity-64k scout-lent)
# The paths written without a GPU and off by default, each with its selftest and its A/B
# (their baselines are core's decode-8k-32k, decode-64k, decode-8k-batch8 and scout-lent).
fresh=$(echo make-model selftest-device-plan scout-lent-device-plan selftest-cpu-flag \
    scout-cpu-flag selftest-graphs decode-graphs decode-8k-batch5-graphs selftest-recall-copy \
    scout-lent-recall-copy)
case "${SET:-all}" in
    all) only="" ;;
    core) only=$core ;;
    fresh) only=$fresh ;;
    rest) only="" SKIP="${SKIP:-} ${core/make-model/} ${fresh/make-model/}" ;;
    *)
        echo "SET=${SET}: expected core, fresh, rest or all" >&2
        exit 2
        ;;
esac
step() {
    local name=$1
    shift
    if [[ " ${SKIP:-} " == *" $name "* ]] || [[ -n "$only" && " $only " != *" $name "* ]]; then
        echo "== $name: skipped (SKIP or SET)" | tee -a "$out/summary.txt"
        return
    fi
    echo "== $name: $*" | tee -a "$out/summary.txt"
    local t0=$SECONDS
    if timeout -k 5 "${step_limit:-$step_timeout}" "$@" >"$out/$name.json" 2>"$out/$name.log"; then
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
# still measures, and the A/B row says so. A selftest left out by SKIP decides nothing (on
# 2026-11-28 a run that skipped it measured every row with resident layers off, unasked).
if [[ " ${SKIP:-} " == *" selftest "* ]]; then
    echo "   selftest skipped: resident layers, attend_warps and gemv as the node decides" |
        tee -a "$out/summary.txt"
elif ! grep -q "^PASS decode step, layers resident on the device" "$out/selftest.json" 2>/dev/null; then
    echo "   resident layers did not pass selftest: DECODE_NODE_RESIDENT_LAYERS=0 from here" |
        tee -a "$out/summary.txt"
    export DECODE_NODE_RESIDENT_LAYERS=0
fi
if [[ ! -f "$model/config.json" ]]; then
    step make-model "$bin" make-model --out "$model" --arch qwen3 --preset qwen3-14b \
        --num-layers "$layers" --dtype bf16
fi
# `attend_warps` is new: where its selftest rows did not pass, the benches take the general
# attention kernel (the node also checks it at start and turns it off on a disagreement).
if grep "^FAIL attend_warps" "$out/selftest.json" 2>/dev/null | grep -qv prefetching; then
    echo "   attend_warps did not pass selftest: DECODE_NODE_ATTENTION_KERNEL=split from here" |
        tee -a "$out/summary.txt"
    export DECODE_NODE_ATTENTION_KERNEL=split
fi
# The L2 prefetch (new 2026-11-30) likewise: a prefetching row that failed turns it off.
if grep "^FAIL attend_" "$out/selftest.json" 2>/dev/null | grep -q prefetching; then
    echo "   a prefetching attention row did not pass selftest: DECODE_NODE_ATTENTION_PREFETCH=off from here" |
        tee -a "$out/summary.txt"
    export DECODE_NODE_ATTENTION_PREFETCH=off
fi
# (The node itself keeps a small-batch kernel that disagrees with cuBLAS at start out; this
# also keeps `gemv_b{B}` out of every A/B below. A failing `gemv_tc` row changes nothing here.)
if grep -q "^FAIL gemv vs" "$out/selftest.json" 2>/dev/null; then
    echo "   gemv did not pass selftest: DECODE_NODE_GEMV=0 from here" | tee -a "$out/summary.txt"
    export DECODE_NODE_GEMV=0
fi
# The device part of attention alone over every block of a context (what `full` reads per
# layer) against the copy bandwidth, per CUDA-block target: the kernel apart from the step.
# By default the node times `attend_tc` (tensor cores, new 2026-11-29, never run on a GPU)
# against `attend_warps` at start and keeps the faster per group ("attention kernel timed at
# start" in the log); then each forced, for the A/B. Each row's `kernel` says which ran.
step device-kernels "$bin" bench kernels --json --device cuda --groups 5 --head-dims 128 \
    --context 8k,32k,64k --ctas 0,1024 --seconds 0.3
grep -h -E "attention (kernel|prefetch) timed at start" "$out/device-kernels.log" |
    sed 's/^.*INFO //' | head -8 | tee -a "$out/summary.txt" || true
# Each kernel forced, without the L2 prefetch of its next loads (new 2026-11-30, never run on a
# GPU; the node times it at start as above), then with it: rows `attend_tc+prefetch`.
# `--ctas 396`: three CUDA blocks an SM on an H200's 132, what attend_tc's registers allow
# (the default aims for two).
for kernel in warps tc; do
    step "device-kernels-$kernel" env DECODE_NODE_ATTENTION_KERNEL=$kernel \
        DECODE_NODE_ATTENTION_PREFETCH=off "$bin" bench kernels \
        --json --device cuda --groups 5,8 --head-dims 128 --context 8k,32k,64k --ctas 0,396 \
        --seconds 0.3
    step "device-kernels-$kernel-prefetch" env DECODE_NODE_ATTENTION_KERNEL=$kernel \
        DECODE_NODE_ATTENTION_PREFETCH=on "$bin" bench kernels \
        --json --device cuda --groups 5,8 --head-dims 128 --context 8k,32k,64k --ctas 0,396 \
        --seconds 0.3
done
# attend_tc with four CUDA blocks an SM (ptxas for sm_90: 128 registers, one 16-dim step of K's
# and one 16-token step of V's loads at a time) where the default holds three (164 registers,
# two steps' loads of each).
step device-kernels-tc-min4 env DECODE_NODE_ATTENTION_KERNEL=tc \
    DECODE_NODE_KERNEL_DEFINES=ATTEND_TC_MIN_BLOCKS=4,ATTEND_TC_KSTEPS=1,ATTEND_TC_VSTEPS=1 \
    "$bin" bench kernels \
    --json --device cuda --groups 5 --head-dims 128 --context 8k,32k,64k --seconds 0.3
# attend_warps' compile-time tunables (`DECODE_NODE_KERNEL_DEFINES`), A/B in one run: at the
# default it takes 255 registers a thread at G = 5 (ptxas for sm_90), so an SM holds two CUDA
# blocks (8 warps; ncu: 12% of warps active); held to three blocks an SM it gets 168, with 8
# loads in flight a lane (LOADS=8) and no spills. With three an SM, 396 CUDA blocks on 132 SMs.
for defs in ATTEND_WARPS_MIN_BLOCKS=3,ATTEND_WARPS_LOADS=8 ATTEND_WARPS_MIN_BLOCKS=3; do
    step "device-kernels-${defs//[=,]/-}" env DECODE_NODE_ATTENTION_KERNEL=warps \
        DECODE_NODE_KERNEL_DEFINES="$defs" "$bin" bench \
        kernels --json --device cuda --groups 5 --head-dims 128 --context 32k,64k --ctas 0,396 \
        --seconds 0.3
done
# Every device-kernels row in one line each, in the summary (which comes back even when the
# archive does not): which kernel, prefetching or not, and its ratio to the copy bandwidth.
python3 - "$out"/device-kernels*.json >>"$out/summary.txt" 2>/dev/null <<'PY' || true
import json, os, sys
print("   device attention alone, ratio to copy bandwidth (file: G, context, kernel, CUDA blocks, ratio):")
for path in sys.argv[1:]:
    try:
        rows = json.load(open(path))["results"]
    except (OSError, ValueError, KeyError):
        continue
    for r in rows:
        pf = "+prefetch" if r.get("prefetch") else ""
        print(f"   {os.path.basename(path)[:-5]}: G={r['group']} ctx={r['context']} "
              f"{r['kernel']}{pf} ctas={r['ctas']} {r['ratio']:.3f}")
PY
# The host's side: its read bandwidth and the CPU attention kernel per thread count. Scout's
# CPU part and its selection (SparQ reads most of 4x the budget's keys) share that bandwidth.
step host-kernels "$bin" bench kernels --json --threads 1,4,8,16 --groups 5 --head-dims 128 \
    --seconds 1
# Scout's host selection alone (Quest's bound, then SparQ's key rows) on this shape, per thread
# count: 12 of scout's 28 ms per step on the H200 in session 22; and the host's part where the
# device scores (the default): top-k and residency plan, 0.05 ms a layer at 64k on an EPYC VM;
# device-picks: the residency plan alone, where the device picked the blocks too (top_blocks).
step host-select "$bin" bench select --json --context 32k,64k --threads 1,4,8,16 --seconds 1 \
    --scorers quest,sparq,device,device-picks
# The dense step alone against the weights' bound, batch 1 and 8. By default each product
# shape's first call times cuBLAS, `gemv_b{B}` and `gemv_tc` (tensor cores, new 2026-11-28,
# never run on a GPU) and keeps the fastest: the log's "small-batch GEMM timed" lines give
# each kernel's microseconds per shape. Then batch 8 with each one forced, for the A/B.
step dense-step "$bin" bench step --json --device cuda --model "$model" --batch 8 --seconds 3
grep -h "small-batch GEMM timed" "$out/dense-step.log" | sed 's/^.*INFO //' | head -20 |
    tee -a "$out/summary.txt" || true
for tactic in cublas gemv tc; do
    step "dense-step-b8-$tactic" env DECODE_NODE_GEMV_TACTIC=$tactic "$bin" bench step --json \
        --device cuda --model "$model" --batch 8 --seconds 2
done
# gemv_tc with 8 chunks' loads in flight a lane instead of 4 (ptxas: 128 registers, so two
# CUDA blocks an SM where the default has three).
step dense-step-b8-tc-chunks8 env DECODE_NODE_GEMV_TACTIC=tc DECODE_NODE_KERNEL_DEFINES=GEMV_TC_CHUNKS=8 \
    "$bin" bench step --json --device cuda --model "$model" --batch 8 --seconds 2
# One round per `bench decode` (its default is 3): the device's bound is one figure, and
# the device time is short.
# Each step's per-layer phases (selection, device, CPU waits) as debug lines in its log.
export RUST_LOG=${RUST_LOG:-info,decode_node::engine::step=debug}
# The sparse rows keep their fixed device share (`--device-blocks`, twice the budget), as
# before 2026-11-30, so they measure the CPU part and compare with earlier runs: by default
# spare device KV is lent, and bench decode's 4 GiB would hold every block of a batch-1
# request, leaving no CPU part. scout-lent measures the default.
export DECODE_NODE_SPARE_DEVICE_KV=off
step decode-8k-32k "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 8k,32k --modes full,hgca,recall,scout --budget-tokens 2048 --tokens 64
step decode-64k "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 64k --modes full,scout --budget-tokens 2048 --tokens 64
# Per-kernel figures where Nsight Compute is installed (the lent machines have ncu in
# /usr/local/cuda/bin, no nsys) and may read the counters. Decode steps are profiled through
# the engine's window (DECODE_NODE_PROFILE_STEPS=BATCH:SKIP:STEPS with --profile-from-start
# off): that many steady steps and nothing of the checks and timings at start, which were
# most of an unwindowed profile (session 53: 814 launches, the step's few among them).
# scripts/ncu-summary.py adds each kernel's launches and microseconds a step to the summary.
# Before the A/B rows below, so a lease cut short still has them; a profiler that fails or
# is refused fails its own steps only.
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
if [[ -n "$ncu" ]]; then
    # name, batch, then the bench decode arguments: two steps after ten of that batch.
    ncu_decode() {
        local name=$1 batch=$2
        shift 2
        step "$name" env DECODE_NODE_PROFILE_STEPS="$batch:10:2" "$ncu" --profile-from-start off \
            --csv --metrics "$metrics" "$bin" bench decode --rounds 1 --json --device cuda \
            --model "$model" --tokens 32 --batch "$batch" "$@"
        if [[ -f "$out/$name.json" ]]; then
            echo "   $name, per step (kernels run alone: no overlap, no gaps):" >>"$out/summary.txt"
            python3 "$(dirname "$0")/ncu-summary.py" "$out/$name.json" 2 2>&1 | head -25 |
                sed 's/^/   /' >>"$out/summary.txt" || true
        fi
    }
    ncu_decode ncu-full-b1-64k 1 --context 64k --modes full
    ncu_decode ncu-scout-b1-64k 1 --context 64k --modes scout --budget-tokens 2048
    ncu_decode ncu-full-b8-8k 8 --context 8k --modes full
    # The attention kernel and its combine over 64k tokens; tc forced, so no timing at start
    # (its calls would fill the launches), past the checks' launches.
    step ncu-attention env DECODE_NODE_ATTENTION_KERNEL=tc "$ncu" --csv --metrics "$metrics" \
        -k "regex:attend_warps|attend_tc|combine_splits" --launch-skip 40 --launch-count 6 \
        "$bin" bench kernels --json --device cuda --groups 5 --head-dims 128 --context 64k \
        --seconds 0.05
else
    echo "== ncu: not installed; no per-kernel profile" | tee -a "$out/summary.txt"
fi
# The sketch's block scores summed in floats (before 2026-11-28: `sketch_lse` now sums in
# integers, __dp4a against the query rounded to int8 as the host does): the kernel's A/B at
# 64k, where it scores 2048 blocks a KV head and layer. Its time is in the engine's step
# lines (debug log) and the device idle share.
step scout-64k-sketch-f32 env DECODE_NODE_SKETCH_SUMS=f32 "$bin" bench decode --rounds 1 --json \
    --device cuda --model "$model" --context 64k --modes scout --budget-tokens 2048 --tokens 64
# `sketch_lse` with one block a warp, as before 2026-11-30 (a CUDA block rounded the query for
# four blocks' rows; now each warp takes enough blocks to fill the device once: four at 64k).
# Not run on a GPU yet; the ncu-scout-b1-64k table has the kernel's time at the default.
step scout-64k-sketch-1-per-warp env DECODE_NODE_SKETCH_BLOCKS_PER_WARP=1 "$bin" bench decode \
    --rounds 1 --json --device cuda --model "$model" --context 64k --modes scout \
    --budget-tokens 2048 --tokens 64
# The host picks the blocks from every score copied back, as before 2026-11-30 (`top_blocks`
# now picks each head's, or the layer's shared budget, on the device, and only the picks come
# back). Not run on a GPU yet; the A/B against decode-8k-32k's and decode-64k's scout rows
# (on the H200, 2026-11-29, the host's selection was 0.76 ms of scout's 7.13 ms step at 64k).
step scout-64k-host-topk env DECODE_NODE_DEVICE_TOPK=off "$bin" bench decode --rounds 1 --json \
    --device cuda --model "$model" --context 32k,64k --modes scout --budget-tokens 2048 --tokens 64
# Scout with its default loan of spare device KV (since 2026-11-30): a request alone whose
# every block fits in what no other request counts on takes room for all of them (2.75 GB a
# request here at 64k), the blocks still on the host go up within the recall budget (64 MiB
# a step: about 42 steps for 2.7 GB, the selected blocks first), and after that the CPU part
# is empty: sparse attention on the device against full's dense one. Not run on a GPU yet.
# 256 tokens, so the steady rate is mostly past that ramp.
step scout-lent env DECODE_NODE_SPARE_DEVICE_KV=on "$bin" bench decode --rounds 1 --json \
    --device cuda --model "$model" --context 32k,64k --modes full,scout --budget-tokens 2048 \
    --tokens 256
# Layers a device plans alone (#21 item 4, written 2026-12-01 without a GPU, off by default):
# where a request holds every block on the device (scout-lent's loans, after the ramp),
# top_blocks' picks go into the attention's list on the device (place_picks) and the layer
# waits for nothing: no query back, no host planning between projections and attention.
# First the selftest with it on (its place_picks row, and the end-to-end "lent" rows against
# the CPU go through it), then scout-lent's scout rows with it on: the A/B against scout-lent.
step selftest-device-plan env DECODE_NODE_DEVICE_PLAN=on "$bin" selftest --device cuda
grep -E "^(PASS|FAIL).*(place_picks|lent)" "$out/selftest-device-plan.json" 2>/dev/null |
    sed 's/^/   /' >>"$out/summary.txt" || true
step scout-lent-device-plan env DECODE_NODE_SPARE_DEVICE_KV=on DECODE_NODE_DEVICE_PLAN=on \
    "$bin" bench decode --rounds 1 --json --device cuda --model "$model" --context 32k,64k \
    --modes scout --budget-tokens 2048 --tokens 256
# CPU partials landing in mapped host memory behind a flag the stream waits on (#21 item 5,
# written 2026-12-01 without a GPU, off by default): the selftest with it on (its start-up
# check and the landing row), then scout at 32k/64k, where a CPU part remains, against
# decode-8k-32k/decode-64k's scout rows.
step selftest-cpu-flag env DECODE_NODE_CPU_FLAG=on "$bin" selftest --device cuda
grep -E "^(PASS|FAIL).*(landed|lent)" "$out/selftest-cpu-flag.json" 2>/dev/null |
    sed 's/^/   /' >>"$out/summary.txt" || true
step scout-cpu-flag env DECODE_NODE_CPU_FLAG=on "$bin" bench decode --rounds 1 --json \
    --device cuda --model "$model" --context 32k,64k --modes scout --budget-tokens 2048 --tokens 64
# A resident layer's second half replayed from a CUDA graph per batch bucket (#21 item 6,
# written 2026-12-02 without a GPU, off by default): selftest with graphs on (the graph row,
# the resident-layer rows through it, the decodes of three requests at once, padded to
# buckets), then full and scout at 8k/32k (batch 1) against decode-8k-32k, and full at
# batch 5 (run padded to the bucket of 8) against decode-8k-batch8.
step selftest-graphs env DECODE_NODE_GRAPHS=on "$bin" selftest --device cuda
grep -E "^(PASS|FAIL).*(graph|resident|at once)" "$out/selftest-graphs.json" 2>/dev/null |
    sed 's/^/   /' >>"$out/summary.txt" || true
step decode-graphs env DECODE_NODE_GRAPHS=on "$bin" bench decode --rounds 1 --json \
    --device cuda --model "$model" --context 8k,32k --modes full,scout --budget-tokens 2048 \
    --tokens 64
step decode-8k-batch5-graphs env DECODE_NODE_GRAPHS=on "$bin" bench decode --rounds 1 --json \
    --device cuda --model "$model" --context 8k --modes full --batch 5 --tokens 64
# Blocks up through the copy engines (#21 item 7, written 2026-12-02 without a GPU, off by
# default): one cuMemcpyBatchAsync a call instead of the gather_copy kernel over the mapped
# pool. The selftest (its copy row, and the attention rows whose blocks go up that way), then
# scout-lent's rows (the most blocks moved a step) against scout-lent.
step selftest-recall-copy env DECODE_NODE_RECALL_COPY=engine "$bin" selftest --device cuda
grep -E "^(PASS|FAIL).*(copy engines|lent)" "$out/selftest-recall-copy.json" 2>/dev/null |
    sed 's/^/   /' >>"$out/summary.txt" || true
step scout-lent-recall-copy env DECODE_NODE_SPARE_DEVICE_KV=on DECODE_NODE_RECALL_COPY=engine \
    "$bin" bench decode --rounds 1 --json --device cuda --model "$model" --context 32k,64k \
    --modes scout --budget-tokens 2048 --tokens 256
# Scout layer-ahead on the device (the paper's behaviour, #21 item 5): the next layer's
# predicted query is scored on the device while it waits for this layer's CPU part
# (queued without a wait), planned while it runs this layer's second half, and its CPU part
# attended then with the predicted query; the device part still reselected by the real
# query (scored before the query rows come back: no second wait). The A/B against
# decode-64k's real-query scout. Then with the device part chosen by the prediction too: one
# wait a layer and nothing planned between it and the attention's launch. Accuracy on
# SmolLM2-135M (7.8k, budget 1024, sketch, guard on, CPU, session 40), top-1 agreement with
# full / KL: 0.914 / 0.044 and 0.914 / 0.046; the real-query default: 0.9805 / 0.0074.
step scout-layer-ahead "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 32k,64k --modes scout --budget-tokens 2048 --tokens 64 --guard-predicted-cpu
step scout-layer-ahead-device "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 32k,64k --modes scout --budget-tokens 2048 --tokens 64 --guard-predicted-cpu \
    --guard-predicted-device
# Scout's CPU part on a quarter of the cores (the default until 2026-11-27; now every core
# but two where the device scores the blocks): what the CPU-attention pool's size is worth.
step decode-cpu-quarter "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 32k,64k --modes scout --budget-tokens 2048 --tokens 64 \
    --cpu-attention-threads "$(( $(nproc) / 4 > 0 ? $(nproc) / 4 : 1 ))"
# Each KV head its own budget (the default until session 32): what a layer's shared budget
# costs on a device, whose slots are per head (a head's blocks past them go to the CPU part).
step decode-head-budgets "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 32k,64k --modes scout --budget-tokens 2048 --tokens 64 --budget-split head
# The sparse modes' selection as it was before the sketch scorer became the default on a
# GPU: sparq on the host (reading host KV), with a layer-ahead prediction.
step decode-sparq "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 32k,64k --modes scout --budget-tokens 2048 --tokens 64 --block-scorer sparq
# Full attention's A/B of attention kernels: `attend_warps` alone (no tensor cores), and the
# general kernel.
step decode-full-warps-kernel env DECODE_NODE_ATTENTION_KERNEL=warps "$bin" bench decode \
    --rounds 1 --json --device cuda --model "$model" --context 8k,32k,64k --modes full --tokens 64
step decode-full-split-kernel env DECODE_NODE_ATTENTION_KERNEL=split "$bin" bench decode \
    --rounds 1 --json --device cuda --model "$model" --context 8k,32k,64k --modes full --tokens 64
# Scout's host selection on the critical path (sparq): the device part by the predicted query
# (no second selection with the real one); Quest's bound alone (no key reads).
step scout-32k-predicted-device "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 32k --modes scout --budget-tokens 2048 --tokens 64 --guard-predicted-device \
    --block-scorer sparq
step scout-32k-quest "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 32k --modes scout --budget-tokens 2048 --tokens 64 --block-scorer quest
# 16-token blocks (more of full's answers on SmolLM2 at 7.8k): `attend_warps_*_b16`.
step decode-32k-block16 "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 32k --modes full,scout --budget-tokens 2048 --tokens 64 --block-size 16
step decode-8k-batch8 "$bin" bench decode --rounds 1 --json --device cuda --model "$model" \
    --context 8k --modes full,scout --batch 8 --tokens 64
# The same rows with every layer driven from the host (resident layers off): #21's A/B.
step decode-8k-host-layers env DECODE_NODE_RESIDENT_LAYERS=0 "$bin" bench decode --rounds 1 --json \
    --device cuda --model "$model" --context 8k --modes full,scout --budget-tokens 2048 \
    --tokens 64
# A trained model, where there is one (SMOLLM2: the GGUF of scripts/fetch-smollm2.sh; 98 MB,
# more than a device call carries beside the binary, so split it: `split -b 40M FILE
# smollm2.part.`, put part aa in dist (with the binary) and ab, ac in dist2, carry `dist` in one
# call and `dist2` in the next, then `cat dist*/smollm2.part.* > /tmp/smollm2.gguf` and
# SMOLLM2=/tmp/smollm2.gguf). Random weights have no locality, so their
# CPU share (0.92 at 64k) is scout's worst case; on real text the CPU measured 0.106 at 7.8k,
# budget 2048. `bench decode` gives the node's speed and CPU share on the device; `bench
# fidelity` the answers against full with the device's projections (it attends on the host).
if [[ -n "${SMOLLM2:-}" && -f "$SMOLLM2" ]]; then
    step decode-smollm2 "$bin" bench decode --rounds 1 --json --device cuda --model "$SMOLLM2" \
        --context 7800 --modes full,scout --budget-tokens 1024 --tokens 64
    step fidelity-smollm2 "$bin" bench fidelity --json --device cuda --model "$SMOLLM2" \
        --context 7800 --modes scout --budgets 1024,2048 --prompts 2 --forced 64
fi
# Its own limit (CAPACITY_TIMEOUT, default 240 s): on 2026-11-28 it was cut at 100 s, after
# scout's 17 pushes, before scout decoded. With the default loans of spare device KV (since
# 2026-11-30; not run on a GPU yet): scout's 19 requests count 3.2 GB of the 40 GiB, and the
# rest is lent (past a 0.17 GB reserve): every block of about 15 of them (2.7 GB each, going up within
# 64 MiB a step each) and the remainder shared evenly as more slots among the other four. 64
# tokens, so more of the steps come after that ramp. The row without loans (the fixed share,
# as on 2026-11-29: 0.62x full) is capacity-64k-fixed-share, in SET=rest.
step_limit=${CAPACITY_TIMEOUT:-240} step capacity-64k env DECODE_NODE_SPARE_DEVICE_KV=on \
    "$bin" bench capacity --json --device cuda --model "$model" \
    --context 64k --modes full,scout --budget-tokens 2048 --tokens 64 \
    --device-kv-bytes 40Gi --host-kv-bytes 48Gi
step_limit=${CAPACITY_TIMEOUT:-240} step capacity-64k-fixed-share "$bin" bench capacity --json \
    --device cuda --model "$model" --context 64k --modes scout --budget-tokens 2048 --tokens 32 \
    --device-kv-bytes 40Gi --host-kv-bytes 48Gi
# Each decode's step phases (medians per batch size) into the summary, which comes back even
# when the archive does not.
if command -v python3 >/dev/null; then
    python3 "$(dirname "$0")/step-log-summary.py" "$out"/*.log 2>/dev/null |
        sed "s|$out/||" >>"$out/summary.txt" || true
fi
# The device tool brings back only a few files (2026-11-28: eight), so the results go back as
# one archive beside the summary; a run cut short leaves them loose, as they were written.
if tar czf "/tmp/gpu-run-$$.tgz" -C "$out" --exclude summary.txt . 2>/dev/null; then
    find "$out" -mindepth 1 ! -name summary.txt -delete
    mv "/tmp/gpu-run-$$.tgz" "$out/results.tgz"
    echo "results in $out/results.tgz (tar xzf)"
else
    echo "results in $out/"
fi
