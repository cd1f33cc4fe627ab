#!/usr/bin/env bash
# The GPU proof in one command, sized to one loan of a GPU machine (docs/gpu-proof.md has its
# timing table): no network, at most --budget seconds (480), ONE archive written.
#   1. preflight (tests/gpu/preflight.py): driver, NVML version, which NVML calls answer, /dev/shm,
#      each call's real latency as the sampler makes it (the sampler cycle's cost)
#   2. the scenarios that prove most in the time (tests/gpu/scenarios.py PROOF) through the
#      harness (tests/gpu/harness.py): nvidia-smi agreement, GPM activity rising with AMP, PCIe
#      bytes per sample rising with a larger transfer, an input-bound and a memory-underused
#      case, one torch profile of a CUDA run (a failure recorded, not fatal); a scenario that
#      would pass the budget is skipped and said so
#   3. timing.json (each stage's seconds) and the archive $OUT/gpu-proof.tar.gz
# Replay, tables and checks run back on any machine from the archive (docs/gpu-proof.md).
# Needs python3 with torch, nvidia-ml-py, aiohttp, prometheus-client, psutil, pyyaml, requests;
# no pytest, no promtool, no compiler. --cpu-demo runs the same on a machine without a GPU: the
# fake NVML driver for the preflight, the demo GPU backend and torch on the CPU (CI runs it).
# Usage: scripts/gpu-proof.sh [--cpu-demo] [--out DIR] [--budget SECONDS] [--seconds N]
#        (PYTHON=... picks the interpreter; OUT=... the folder, as the device tool sets it)
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp/gpu-proof-out}
budget=480
cpu=0
seconds=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-demo) cpu=1 ;;
        --out) out=$2; shift ;;
        --budget) budget=$2; shift ;;
        --seconds) seconds=$2; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "gpu-proof.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
start=$(date +%s)
deadline=$((start + budget - 20))  # the last 20 s: the archive
work=$(mktemp -d)
run=$work/gpu-proof
mkdir -p "$run" "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timing=()
stage() {  # stage NAME SECONDS_SINCE
    timing+=("\"$1\": $(( $(date +%s) - $2 ))")
}

t=$(date +%s)
if [ "$cpu" = 1 ]; then fake=--fake; else fake=; fi
timeout 120 "$py" tests/gpu/preflight.py --out "$run/preflight.json" $fake 2>&1 \
    | tee "$run/preflight.log"
stage preflight "$t"

t=$(date +%s)
if [ "$cpu" = 1 ]; then
    scenarios=$("$py" -c 'from tests.gpu.scenarios import CPU_PROOF; print(",".join(CPU_PROOF))')
    harness_args=(--cpu-demo --seconds "${seconds:-30}" --warmup 5 --no-profile)
else
    scenarios=$("$py" -c 'from tests.gpu.scenarios import PROOF; print(",".join(PROOF))')
    profiled=$("$py" -c 'from tests.gpu.scenarios import PROOF_PROFILED; print(PROOF_PROFILED)')
    harness_args=(--seconds "${seconds:-40}" --warmup 10 --profile-only "$profiled")
fi
timeout $((deadline - $(date +%s))) "$py" tests/gpu/harness.py --out "$run" \
    --scenarios "$scenarios" --deadline "$deadline" "${harness_args[@]}" 2>&1 \
    | tee "$run/harness.log"
harness_rc=${PIPESTATUS[0]}
stage scenarios "$t"
stage total "$start"
printf '{"budget": %s, "harness_returncode": %s, %s}\n' "$budget" "$harness_rc" \
    "$(IFS=,; echo "${timing[*]}")" > "$run/timing.json"
tar czf "$out/gpu-proof.tar.gz" -C "$work" gpu-proof
rm -rf "$work"
echo "gpu-proof: $out/gpu-proof.tar.gz ($(cat "$out/gpu-proof.tar.gz" | wc -c) bytes," \
     "harness exit $harness_rc, $(( $(date +%s) - start )) s)"
exit "$harness_rc"
