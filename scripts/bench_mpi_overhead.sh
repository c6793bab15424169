#!/usr/bin/env bash
# What `mpirun -np 1` costs over one plain process (issue 18's target: at most
# 2% on the Llama-3-8B shape): the same `bakron quantize --backend cuda` job
# run alternately plain and under `mpirun -np 1 --bind-to none`, wall time of
# the whole command (MPI start-up included) and report.json's total.
#
#   scripts/bench_mpi_overhead.sh MODEL_DIR CALIB.safetensors OUTDIR
#
# Environment:
#   BK_BAKRON       the CLI (default build/bakron)
#   BENCH_HESSIAN   --hessian (default gptq)
#   BENCH_PATTERN   the order of the runs, p = plain, m = mpirun -np 1
#                   (default pmp: the plain runs before and after average out drift)
#   BENCH_LAYERS    quantize only layers A:B (default: all)
#   BENCH_GPU_MATH  --gpu-math (default auto)
#   BENCH_EXTRA     more quantize options
#   BENCH_TIMEOUT   seconds per run (default 900)
# Writes OUTDIR/mpi_overhead.txt (one line per run and the result) and
# OUTDIR/mpi_overhead.jsonl; the quantized outputs are removed after each run.
set -uo pipefail
MODEL=${1:?usage: scripts/bench_mpi_overhead.sh MODEL_DIR CALIB OUTDIR}
CALIB=${2:?usage: scripts/bench_mpi_overhead.sh MODEL_DIR CALIB OUTDIR}
OUT=${3:?usage: scripts/bench_mpi_overhead.sh MODEL_DIR CALIB OUTDIR}
BK=${BK_BAKRON:-build/bakron}
mkdir -p "$OUT"
TXT=$OUT/mpi_overhead.txt
JSONL=$OUT/mpi_overhead.jsonl
: >"$JSONL"
if [ "$(id -u)" -eq 0 ]; then # Open MPI refuses root without these
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
args=(--hessian "${BENCH_HESSIAN:-gptq}" --levels 3 --backend cuda --gpu-pipeline
      --gpu-math "${BENCH_GPU_MATH:-auto}")
[ -n "${BENCH_LAYERS:-}" ] && args+=(--layers "$BENCH_LAYERS")
# shellcheck disable=SC2206
[ -n "${BENCH_EXTRA:-}" ] && args+=($BENCH_EXTRA)
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "bakron: $("$BK" --version)"
    echo "mpirun: $(mpirun --version 2>&1 | head -1)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    echo "model: $MODEL; options: ${args[*]}; pattern ${BENCH_PATTERN:-pmp}"
} | tee "$TXT"
status=0
pattern=${BENCH_PATTERN:-pmp}
for ((i = 0; i < ${#pattern}; i++)); do
    kind=${pattern:i:1}
    q=$OUT/q-run$i
    rm -rf "$q"
    pre=()
    [ "$kind" = m ] && pre=(mpirun -np 1 --bind-to none)
    t0=$(date +%s.%N)
    timeout "${BENCH_TIMEOUT:-900}" "${pre[@]}" "$BK" quantize "$MODEL" --calib "$CALIB" \
        "${args[@]}" --out "$q" >"$OUT/log-run$i.txt" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    if [ $rc != 0 ] || [ ! -f "$q/report.json" ]; then
        echo "run $i ($kind): FAILED (exit $rc): $(tail -1 "$OUT/log-run$i.txt")" | tee -a "$TXT"
        status=1
        rm -rf "$q"
        continue
    fi
    python3 - "$q/report.json" "$kind" "$t0" "$t1" <<'EOF' | tee -a "$JSONL"
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"kind": "mpirun -np 1" if sys.argv[2] == "m" else "plain",
                  "wall_s": float(sys.argv[4]) - float(sys.argv[3]),
                  "total_s": r["times_s"]["total"], "mpi": r.get("mpi")}))
EOF
    rm -rf "$q"
done
python3 - "$JSONL" <<'EOF' | tee -a "$TXT"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for k in ("wall_s", "total_s"):
    p = [r[k] for r in rows if r["kind"] == "plain"]
    m = [r[k] for r in rows if r["kind"] != "plain"]
    if not p or not m:
        print("not enough runs"); sys.exit(1)
    mp, mm = sum(p) / len(p), sum(m) / len(m)
    print(f"{k}: plain {' '.join(f'{x:.2f}' for x in p)} (mean {mp:.2f}); mpirun -np 1 "
          f"{' '.join(f'{x:.2f}' for x in m)} (mean {mm:.2f}); overhead {100 * (mm - mp) / mp:+.2f}%"
          f" (target <= 2%; spread of the plain runs {100 * (max(p) - min(p)) / mp:.2f}%)")
EOF
exit $status
