#!/usr/bin/env bash
# Where the time of a backprop quantize goes on a GPU (issue 16): runs
# `bakron quantize --hessian H --bwd-precision P` with BK_PROFILE=1 for each
# H x P given, and prints per run the wall time, report.json's stage times
# (forward includes the flow's), the flow's own forward / backward / head
# times, where the input-side stages ran, and the profile lines of the flow
# (bwd.*: each mark synchronises the stream, so they add up to the flow's
# time) and of the layer driver (bp.*, pipe.*).
#
#   scripts/gpu_backprop_speed.sh MODEL CALIB OUTDIR [quantize options...]
#
# Environment: BK_BAKRON (default build-gpu/bakron), HESSIANS (default
# "backprop-kfac backprop-shampoo"), PRECISIONS (default "fp32 bf16"),
# TIMEOUT seconds per run (default 500), BACKEND (default cuda; cpu: a dry run
# of this script). Example (SmolLM2 of
# scripts/gpu_smollm2_setup.sh, 128 x 512 tokens, as the quality protocol):
#   scripts/gpu_backprop_speed.sh data/smollm2/model data/smollm2/pool-512.safetensors \
#       /tmp/bps --samples 128
set -uo pipefail
MODEL=${1:?usage: scripts/gpu_backprop_speed.sh MODEL CALIB OUTDIR [options]}
CALIB=${2:?usage: scripts/gpu_backprop_speed.sh MODEL CALIB OUTDIR [options]}
OUT=${3:?usage: scripts/gpu_backprop_speed.sh MODEL CALIB OUTDIR [options]}
shift 3
B=${BK_BAKRON:-build-gpu/bakron}
mkdir -p "$OUT"
for H in ${HESSIANS:-backprop-kfac backprop-shampoo}; do
    for P in ${PRECISIONS:-fp32 bf16}; do
        q="$OUT/q-$H-$P"
        log="$OUT/$H-$P.log"
        t0=$(date +%s.%N)
        BK_PROFILE=1 timeout "${TIMEOUT:-500}" "$B" quantize "$MODEL" --calib "$CALIB" \
            --hessian "$H" --bwd-precision "$P" --backend "${BACKEND:-cuda}" --out "$q" --overwrite "$@" \
            >"$log" 2>&1
        rc=$?
        t1=$(date +%s.%N)
        echo "== $H --bwd-precision $P $*: exit $rc, wall $(python3 -c "print(round($t1 - $t0, 1))") s"
        if [ -f "$q/report.json" ]; then
            python3 - "$q/report.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
t = r.get("times_s", {})
b = r.get("backprop", {})
print("  times_s:", ", ".join(f"{k} {v:.2f}" for k, v in t.items() if isinstance(v, (int, float))))
print("  flow: device", b.get("device"), "precision", b.get("precision"), "input stages",
      b.get("input_stages"), "passes", b.get("passes"), "depth", b.get("max_depth"),
      "| flow times_s:", ", ".join(f"{k} {v:.2f}" for k, v in b.get("times_s", {}).items()))
print("  peak boundary host MiB %.0f, micro-batch device MiB %.0f" % (
    b.get("peak_boundary_host_bytes", 0) / 2**20, b.get("micro_batch_device_bytes", 0) / 2**20))
print("  stages:", r.get("stages_detail", r.get("stages", "")))
EOF
        else
            tail -3 "$log"
        fi
        grep -E "^profile (bwd\.|bp\.|pipe\.|fwd\.|g\.)" "$log" | sed 's/^/  /'
        rm -rf "$q"
    done
done
