#!/usr/bin/env bash
# The issue-6 benchmark on a GPU host: make a synthetic Llama-shaped
# checkpoint (scripts/make_synthetic_llama.py, PyTorch generator) unless it
# exists, then time `bakron quantize --backend cuda` end to end per --hessian
# (scripts/bench_pipeline.sh), appending to OUTDIR/bench_SHAPE.txt/.jsonl.
#
#   scripts/gpu_pipeline_bench.sh SHAPE OUTDIR [HESSIAN ...]
#
# SHAPE: 8b or 1b (docs/BENCHMARKS.md "Pipeline on the GPU"), 70b or 405b
# (widths of Llama-3-70B / 405B, with SYN_LAYERS layers: the full depth does
# not fit the GPU host's disk; docs/DISTRIBUTED.md "Large widths"). Environment:
#   BK_BAKRON            the CLI (default build-gpu/bakron)
#   SYN_DIR              where the checkpoint lives (default /tmp/syn-SHAPE; kept)
#   SYN_SEQS, SYN_LEN    calibration sequences x tokens (default 256 x 2048)
#   SYN_LAYERS           number of layers (default: the shape's; 70b: 80, 405b: 126)
#   BENCH_*              passed to scripts/bench_pipeline.sh (BENCH_TIMEOUT,
#                        BENCH_LAYERS, BENCH_GPU_MATH, BENCH_EXTRA, ...)
#   BENCH_PROFILE=1      run with BK_PROFILE=1 and collect each run's profile
#                        lines in OUTDIR/profile_SHAPE.txt (one top-level file:
#                        a device call brings back only a limited number of files)
set -uo pipefail
SHAPE=${1:?usage: scripts/gpu_pipeline_bench.sh 8b|1b|70b|405b OUTDIR [HESSIAN ...]}
OUT=${2:?usage: scripts/gpu_pipeline_bench.sh 8b|1b|70b|405b OUTDIR [HESSIAN ...]}
shift 2
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
DIR=${SYN_DIR:-/tmp/syn-$SHAPE${SYN_LAYERS:+-$SYN_LAYERS}}
if [ ! -f "$DIR/config.json" ] || [ ! -f "$DIR/calib.safetensors" ]; then
    t0=$(date +%s)
    python3 scripts/make_synthetic_llama.py "$DIR" --shape "$SHAPE" --generator torch \
        --calib-seqs "${SYN_SEQS:-256}" --calib-len "${SYN_LEN:-2048}" \
        ${SYN_LAYERS:+--layers "$SYN_LAYERS"} 2>&1 | tail -1
    echo "synthetic $SHAPE checkpoint: $(( $(date +%s) - t0 )) s, $(du -sh "$DIR" | cut -f1)"
fi
export BK_BAKRON=${BK_BAKRON:-build-gpu/bakron}
export BENCH_HESSIANS=${*:-gptq mlplocal-kfac fullylocal-kfac}
export BENCH_WORK=${BENCH_WORK:-/tmp/bench-work}
[ "${BENCH_PROFILE:-0}" = 1 ] && export BK_PROFILE=1
sub=$OUT/run-$SHAPE
rm -rf "$sub"
scripts/bench_pipeline.sh "$DIR" "$DIR/calib.safetensors" "$sub"
rc=$?
cat "$sub/bench_pipeline.txt" >>"$OUT/bench_$SHAPE.txt"
cat "$sub/bench_pipeline.jsonl" >>"$OUT/bench_$SHAPE.jsonl"
if [ "${BENCH_PROFILE:-0}" = 1 ]; then
    for f in "$sub"/log-*.txt; do
        [ -f "$f" ] && { echo "== $(basename "$f" .txt) ($(date -u +%FT%TZ))"; grep '^profile' "$f"; } \
            >>"$OUT/profile_$SHAPE.txt"
    done
fi
for f in "$sub"/log-*.txt; do
    [ -f "$f" ] && { echo "== $f"; tail -5 "$f"; } >>"$OUT/bench_$SHAPE.logtail"
done
exit $rc
