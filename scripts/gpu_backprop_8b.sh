#!/usr/bin/env bash
# The backprop kinds at a Llama size on a GPU (issue 16's speed and memory
# targets): one `bakron quantize --hessian backprop-*` on a synthetic
# checkpoint, profiled (BK_PROFILE=1), with the process's resident set
# (VmHWM/VmRSS), the GPU's memory in use (nvidia-smi) and the host's used /
# available memory sampled every 2 s; stopped by SIGINT after LIMIT seconds
# (the job then stops cleanly and keeps its layers for --resume; the profile,
# printed at the end, is lost). Writes OUTDIR/run.log, poll.log,
# report.json (when the job finished) and summary.txt.
#
#   scripts/gpu_backprop_8b.sh OUTDIR [quantize options...]
#
# Environment: SHAPE (8b; 1b, 70b as scripts/make_synthetic_llama.py), SYN_DIR
# (default /tmp/syn-$SHAPE, made with 256 x 2048 calibration tokens when
# missing), BK_BAKRON (default build-gpu/bakron), HESSIAN (backprop-kfac),
# PRECISION (bf16), BACKEND (cuda; cpu: a dry run of this script), LIMIT seconds
# before the SIGINT (default 540). Example
# (the 80 GB card emulated on the H200):
#   scripts/gpu_backprop_8b.sh /tmp/bp8 --setting mem_limit=80000000000
# Run from the repository root after `source scripts/device-env.sh`. The
# job's own waits are by pid: no bare `wait` (docs/DEVICE.md).
set -uo pipefail
OUT=${1:?usage: scripts/gpu_backprop_8b.sh OUTDIR [quantize options...]}
shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SHAPE=${SHAPE:-8b}
DIR=${SYN_DIR:-/tmp/syn-$SHAPE}
B=${BK_BAKRON:-build-gpu/bakron}
LIMIT=${LIMIT:-540}
if [ ! -f "$DIR/config.json" ] || [ ! -f "$DIR/calib.safetensors" ]; then
    t0=$(date +%s)
    python3 scripts/make_synthetic_llama.py "$DIR" --shape "$SHAPE" --generator torch \
        --calib-seqs 256 --calib-len 2048 >"$OUT/synthetic.log" 2>&1 ||
        { echo "gpu_backprop_8b: making $DIR failed (see $OUT/synthetic.log)" >&2; exit 2; }
    echo "synthetic $SHAPE checkpoint: $(( $(date +%s) - t0 )) s" | tee "$OUT/summary.txt"
else
    : >"$OUT/summary.txt"
fi
Q="$OUT/q"
echo "command: BK_PROFILE=1 $B quantize $DIR --calib $DIR/calib.safetensors --hessian ${HESSIAN:-backprop-kfac} --bwd-precision ${PRECISION:-bf16} --backend ${BACKEND:-cuda} --levels 3 --out $Q --overwrite $*" >>"$OUT/summary.txt"
t0=$(date +%s.%N)
BK_PROFILE=1 "$B" quantize "$DIR" --calib "$DIR/calib.safetensors" --hessian "${HESSIAN:-backprop-kfac}" \
    --bwd-precision "${PRECISION:-bf16}" --backend "${BACKEND:-cuda}" --levels 3 --out "$Q" --overwrite "$@" \
    >"$OUT/run.log" 2>&1 &
P=$!
S=$(date +%s)
: >"$OUT/poll.log"
while kill -0 "$P" 2>/dev/null; do
    el=$(( $(date +%s) - S ))
    hwm=$(awk '/VmHWM/{print $2}' "/proc/$P/status" 2>/dev/null)
    rss=$(awk '/VmRSS/{print $2}' "/proc/$P/status" 2>/dev/null)
    dev=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
    mem=$(free -m | awk '/Mem:/{print $3, $7}')
    echo "$el ${hwm:-0} ${rss:-0} ${dev:-0} $mem" >>"$OUT/poll.log"
    if [ "$el" -ge "$LIMIT" ]; then
        kill -INT "$P" 2>/dev/null
        echo "SIGINT at $el s" >>"$OUT/summary.txt"
        for _ in $(seq 60); do kill -0 "$P" 2>/dev/null || break; sleep 1; done
        kill -KILL "$P" 2>/dev/null
        break
    fi
    sleep 2
done
wait "$P"
rc=$?
t1=$(date +%s.%N)
[ -f "$Q/report.json" ] && cp "$Q/report.json" "$OUT/report.json"
python3 - "$OUT" "$rc" "$t0" "$t1" <<'EOF' >>"$OUT/summary.txt"
import json, os, sys
out, rc, t0, t1 = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
print(f"exit {rc}, wall {t1 - t0:.1f} s")
rows = [l.split() for l in open(os.path.join(out, "poll.log")) if l.strip()]
if rows:
    # seconds, VmHWM kB, VmRSS kB, GPU MiB used, host used MiB, host available MiB
    print(f"peak resident set {max(int(r[1]) for r in rows) / 1048576:.1f} GiB (VmHWM, includes the mapped checkpoint), "
          f"GPU memory in use at most {max(int(r[3]) for r in rows)} MiB (nvidia-smi every 2 s), "
          f"host used at most {max(int(r[4]) for r in rows)} MiB, available at least {min(int(r[5]) for r in rows)} MiB")
log = open(os.path.join(out, "run.log")).read().splitlines()
print("\n".join(l for l in log if "backward pass" in l and " of " in l and "sequences" not in l))
print("\n".join(l for l in log[-3:]))
rp = os.path.join(out, "report.json")
if os.path.exists(rp):
    r = json.load(open(rp))
    print("times_s", json.dumps(r.get("times_s")))
    print("peak_device_bytes", r.get("peak_device_bytes"), "batch", r.get("batch"))
    bp = r.get("backprop", {})
    keys = ["leaf_size", "passes", "max_depth", "micro_batch_device_bytes", "peak_boundary_host_bytes",
            "planned_peak_boundary_host_bytes", "resident_layers", "weight_requests", "weight_uploads",
            "host_weight_copies_kind", "times_s"]
    print("backprop", json.dumps({k: bp.get(k) for k in keys if k in bp}))
prof = [l for l in log if l.startswith("profile ")]
if prof:
    print("\n".join(prof[:80]))
EOF
cat "$OUT/summary.txt"
exit "$rc"
