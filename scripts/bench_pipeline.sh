#!/usr/bin/env bash
# Time `bakron quantize --backend cuda` (the whole job on the GPU) end to end on a model
# (e.g. one made by scripts/make_synthetic_llama.py), per --hessian kind at
# levels 3 (2.81 bits), with the per-stage breakdown of report.json, the
# solver share and the peak GPU / host memory (docs/BENCHMARKS.md "Pipeline
# on the GPU").
#
#   scripts/bench_pipeline.sh MODEL_DIR CALIB.safetensors OUTDIR
#
# Environment:
#   BK_BAKRON        the CLI (default build/bakron)
#   BENCH_HESSIANS   kinds to time (default "gptq mlplocal-kfac fullylocal-kfac")
#   BENCH_SAMPLES    calibration sequences (default: all in the file)
#   BENCH_SEQLEN     tokens per sequence (default: as in the file)
#   BENCH_LAYERS     quantize only layers A:B (default: all)
#   BENCH_BATCH      micro-batch (default: automatic)
#   BENCH_EXTRA      more quantize options (e.g. "--precision fp64")
#   BENCH_CPU_STAGES=1  forward + Hessians on the CPU (--cpu-stages) instead
#   BENCH_GPU_MATH   auto (default), tf32, bf16 or fp32: the GPU stages' GEMM arithmetic
#   BENCH_BACKEND    the solves' backend (default cuda; cpu with BENCH_CPU_STAGES=1
#                    to try the script without a GPU)
#   BENCH_TIMEOUT    seconds per run (default 1800)
#   BENCH_WORK       folder for the quantized outputs (default OUTDIR; removed per run)
# Writes OUTDIR/bench_pipeline.txt (the table) and OUTDIR/bench_pipeline.jsonl
# (one object per run); the quantized outputs are removed after each run.
set -uo pipefail
MODEL=${1:?usage: scripts/bench_pipeline.sh MODEL_DIR CALIB OUTDIR}
CALIB=${2:?usage: scripts/bench_pipeline.sh MODEL_DIR CALIB OUTDIR}
OUT=${3:?usage: scripts/bench_pipeline.sh MODEL_DIR CALIB OUTDIR}
BK=${BK_BAKRON:-build/bakron}
mkdir -p "$OUT"
TXT=$OUT/bench_pipeline.txt
JSONL=$OUT/bench_pipeline.jsonl
: >"$JSONL"
args=(--levels 3 --backend "${BENCH_BACKEND:-cuda}")
if [ "${BENCH_CPU_STAGES:-0}" = 1 ]; then
    [ "${BENCH_BACKEND:-cuda}" = cuda ] && args+=(--cpu-stages)
else
    args+=(--gpu-pipeline --gpu-math "${BENCH_GPU_MATH:-auto}")
fi
[ -n "${BENCH_SAMPLES:-}" ] && args+=(--samples "$BENCH_SAMPLES")
[ -n "${BENCH_SEQLEN:-}" ] && args+=(--seqlen "$BENCH_SEQLEN")
[ -n "${BENCH_LAYERS:-}" ] && args+=(--layers "$BENCH_LAYERS")
[ -n "${BENCH_BATCH:-}" ] && args+=(--batch "$BENCH_BATCH")
# shellcheck disable=SC2206
[ -n "${BENCH_EXTRA:-}" ] && args+=($BENCH_EXTRA)
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    # BK_COMMIT: the commit when the tree was copied without its history
    # (e.g. a device call; pass BK_COMMIT=$(git rev-parse --short HEAD))
    if [ -n "${BK_COMMIT:-}" ]; then echo "commit: $BK_COMMIT (BK_COMMIT)"; else
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"; fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    echo "model: $MODEL; calibration: $CALIB; options: ${args[*]}"
} | tee "$TXT"
status=0
for h in ${BENCH_HESSIANS:-gptq mlplocal-kfac fullylocal-kfac}; do
    mkdir -p "${BENCH_WORK:-$OUT}"
    q=${BENCH_WORK:-$OUT}/q-$h
    rm -rf "$q"
    # peak host memory: the child's maximum resident set (getrusage)
    python3 - "$q.rss" timeout "${BENCH_TIMEOUT:-1800}" "$BK" quantize "$MODEL" --calib "$CALIB" \
        --hessian "$h" --out "$q" "${args[@]}" >"$OUT/log-$h.txt" 2>&1 <<'EOF'
import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc)
EOF
    rc=$?
    if [ $rc != 0 ] || [ ! -f "$q/report.json" ]; then
        echo "$h: FAILED (exit $rc): $(tail -1 "$OUT/log-$h.txt")" | tee -a "$TXT"
        status=1
        continue
    fi
    python3 - "$q/report.json" "$(cat "$q.rss")" "$h" <<'EOF' >>"$JSONL"
import json, sys
r = json.load(open(sys.argv[1]))
t = r["times_s"]
q = r["quantization"]
print(json.dumps({"hessian": sys.argv[3], "total_s": t["total"], "forward_s": t["forward"],
                  "hessian_s": t["hessian"], "factor_s": t["factor"], "solve_s": t["solve"],
                  "io_s": t["io"], "solver_share": (t["factor"] + t["solve"]) / t["total"],
                  "peak_gpu_mib": r.get("peak_device_bytes", 0) / 2**20,
                  "peak_host_mib": int(sys.argv[2]) / 1024, "stages": r.get("stages"),
                  "stages_detail": r.get("stages_detail", ""), "batch": r.get("batch"),
                  "gpu_math": r.get("gpu_math"),
                  "device": r.get("device"), "quantization": q}))
EOF
    rm -rf "$q" "$q.rss"
done
rm -rf "${BENCH_WORK:-$OUT}"/q-*.tmp-* 2>/dev/null
python3 - "$JSONL" <<'EOF' | tee -a "$TXT"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if rows:
    print(rows[0].get("stages_detail", ""))
print("%-18s %8s %8s %8s %8s %8s %8s %7s %9s %9s" % ("hessian", "total s", "forward", "hessian",
      "factor", "solve", "io", "solver%", "GPU MiB", "host MiB"))
for r in rows:
    print("%-18s %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %6.1f%% %9.0f %9.0f" % (
        r["hessian"], r["total_s"], r["forward_s"], r["hessian_s"], r["factor_s"], r["solve_s"],
        r["io_s"], 100 * r["solver_share"], r["peak_gpu_mib"], r["peak_host_mib"]))
EOF
exit $status
