#!/usr/bin/env bash
# Build bakron with the CUDA backend, run the GPU test suite and the
# benchmarks, and write logs and JSON results into OUTDIR (docs/DEVICE.md).
#
#   scripts/gpu_run.sh OUTDIR
#
# Environment:
#   BK_GPU_STAGES   comma-separated subset of
#                   build,validate,bench_core,test,test_slow,bench
#                   (default: all of them, in that order)
#   BK_GPU_BUILD    build folder (default build-gpu)
#   BK_GPU_TARGETS  ninja targets to build (default: the CLI, the dev harness and
#                   every program of the cuda test suite; "all" for everything)
#   BK_BENCH_SHAPES shapes for `bakron bench` (default: the paper's Table 3 set)
#   BK_BENCH_REPEAT repeats per measurement (default 3)
#   BK_ANTIDIAG_SHAPES shapes on which antidiag is also timed (default up to 4096x4096)
#   BK_ANTIDIAG_MAX    bench_core: antidiag is timed up to this m*n (default 4096^2)
#   BK_T_VALIDATE, BK_T_TEST, BK_T_BENCH  per-stage time limits in seconds
#
# On an offline host whose repository carries .debs/ (cJSON, cmocka, OpenBLAS,
# LAPACKE), the packages are unpacked first by scripts/device-env.sh.
# At most eight files are written: env.txt build.log validate.log test.log
# bench_core.log bench.json bench.txt summary.txt. Exit status: non-zero when
# the build, a test or the validation failed.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_run.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
if [ -d .debs ] && ! pkg-config --exists libcjson libpcre2-8 libutf8proc 2>/dev/null; then
    # shellcheck source=/dev/null
    source scripts/device-env.sh
fi
export PATH=/usr/local/cuda/bin:$PATH
B=${BK_GPU_BUILD:-build-gpu}
STAGES=${BK_GPU_STAGES:-build,validate,bench_core,test,test_slow,bench}
SHAPES=${BK_BENCH_SHAPES:-1024x1024,2048x2048,4096x4096,8192x8192,8192x2048,2048x8192,14336x4096,4096x14336}
ADSHAPES=${BK_ANTIDIAG_SHAPES:-1024x1024,2048x2048,4096x4096}
REPEAT=${BK_BENCH_REPEAT:-3}
JOBS=$(nproc 2>/dev/null || echo 4)
SUM="$OUT/summary.txt"
status=0
has() { case ",$STAGES," in *,"$1",*) return 0 ;; esac; return 1; }
note() { echo "$*" | tee -a "$SUM"; }
: > "$SUM"

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    # BK_COMMIT: the commit when the tree was copied without its history
    # (e.g. a device call; pass BK_COMMIT=$(git rev-parse --short HEAD))
    if [ -n "${BK_COMMIT:-}" ]; then echo "commit: $BK_COMMIT (BK_COMMIT)"; else
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"; fi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    nvcc --version 2>&1 | tail -1
    echo "pkg-config: openblas $(pkg-config --modversion openblas 2>&1), lapacke $(pkg-config --modversion lapacke 2>&1), cjson $(pkg-config --modversion libcjson 2>&1), cmocka $(pkg-config --modversion cmocka 2>&1)"
    echo "stages: $STAGES"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if has build; then
    t0=$(date +%s)
    if [ -d "$B" ]; then
        meson configure "$B" -Dcuda=enabled > "$OUT/build.log" 2>&1
    else
        meson setup "$B" -Dcuda=enabled -Dbuildtype=release > "$OUT/build.log" 2>&1
    fi
    # only what the GPU stages run: the CLI, the dev harness and every program of
    # the cuda test suite, as meson lists them (the whole tree with BK_GPU_TARGETS=all)
    if [ -z "${BK_GPU_TARGETS:-}" ]; then
        TARGETS="bakron tests/bk-cuda-dev $(meson introspect "$B" --tests | python3 -c '
import json, os, sys
build = os.path.realpath(sys.argv[1])
out = set()
for t in json.load(sys.stdin):
    if not any(s.split(":")[-1] == "cuda" for s in t["suite"]):
        continue
    exe = os.path.realpath(t["cmd"][0])
    if exe.startswith(build + os.sep):
        out.add(os.path.relpath(exe, build))
print(" ".join(sorted(out)))' "$B")" || TARGETS=
    else
        TARGETS=$BK_GPU_TARGETS
    fi
    [ "$TARGETS" = all ] && TARGETS=
    # shellcheck disable=SC2086
    if ! ninja -C "$B" -j "$JOBS" $TARGETS >> "$OUT/build.log" 2>&1; then
        note "build: FAILED (see build.log)"
        tail -30 "$OUT/build.log"
        exit 1
    fi
    note "build: ok ($(( $(date +%s) - t0 )) s, $(grep -c 'warning' "$OUT/build.log") warning lines)"
fi

if has validate; then
    t0=$(date +%s)
    timeout "${BK_T_VALIDATE:-300}" "$B/tests/bk-cuda-dev" validate > "$OUT/validate.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then
        note "validate: ok ($(( $(date +%s) - t0 )) s)"
    else
        status=1
        note "validate: FAILED (rc $rc, see validate.log)"
        grep -E "FAIL|ERROR" "$OUT/validate.log" | head -20 | tee -a "$SUM"
    fi
fi

if has bench_core; then
    t0=$(date +%s)
    timeout "${BK_T_BENCH:-900}" "$B/tests/bk-cuda-dev" bench --variants --reps "$REPEAT" \
        --antidiag-max "${BK_ANTIDIAG_MAX:-$((4096 * 4096))}" > "$OUT/bench_core.log" 2>&1
    note "bench_core: rc $? ($(( $(date +%s) - t0 )) s)"
    grep -v '^JSON' "$OUT/bench_core.log" | tee -a "$SUM"
fi

run_tests() { # $1 = extra meson test args, $2 = label
    t0=$(date +%s)
    # shellcheck disable=SC2086
    if timeout "${BK_T_TEST:-1500}" meson test -C "$B" --no-rebuild $1 --print-errorlogs \
        >> "$OUT/test.log" 2>&1; then
        note "$2: ok ($(( $(date +%s) - t0 )) s)"
    else
        status=1
        note "$2: FAILED (see test.log)"
    fi
    grep -E "^ *[0-9]+/[0-9]+ " "$OUT/test.log" | tail -5 >> "$SUM"
    cat "$B/meson-logs/testlog.txt" >> "$OUT/test.log" 2>/dev/null
}
: > "$OUT/test.log"
has test && run_tests "--suite cuda --no-suite slow" "test (suite cuda)"
has test_slow && run_tests "cuda_parity_fp32_large" "test (fp32 1024^2 and 1024x2816 parity)"

if has bench; then
    t0=$(date +%s)
    BK="$B/bakron"
    {
        timeout 1200 "$BK" bench --backend cuda --algorithms bakron,gptq --shapes "$SHAPES" \
            --repeat "$REPEAT" --json
        timeout 900 "$BK" bench --backend cuda --algorithms bakron,antidiag --shapes "$ADSHAPES" \
            --repeat 1 --json
    } > "$OUT/bench.json" 2> "$OUT/bench.txt"
    note "bench: rc $? ($(( $(date +%s) - t0 )) s)"
    python3 - "$OUT/bench.json" <<'EOF' | tee -a "$SUM"
import json, sys
txt = open(sys.argv[1]).read()
dec, i, rows = json.JSONDecoder(), 0, []
while i < len(txt):
    while i < len(txt) and txt[i].isspace():
        i += 1
    if i >= len(txt):
        break
    obj, i = dec.raw_decode(txt, i)
    rows += obj.get("results", [])
print("%-12s %-9s %10s %10s %9s %12s" % ("shape", "alg", "median_s", "factor_s", "GFLOP/s", "diff_vs_bk"))
for r in rows:
    if r.get("skipped"):
        continue
    d = r.get("code_diff_vs_bakron")
    print("%-12s %-9s %10.4f %10.4f %9.1f %12s" % ("%dx%d" % (r["m"], r["n"]), r["algorithm"],
          r["median_s"], r["factor_s"], r["gflops"], "-" if d is None else "%.4f%%" % (100 * d)))
# issue 20's two numbers for bakron over the square shapes: the scaling exponent
# between consecutive sizes (log of the time ratio over log of the size ratio; the
# work grows as n^3) and the ratio to the fp32 floor, m n (m + n) / 2 FMA at the
# measured cuBLAS SGEMM rate of the H200 (51 TFLOP/s, cuda/dev/NOTES.md)
import math
sq = {}
for r in rows:
    if r.get("algorithm") == "bakron" and r["m"] == r["n"] and not r.get("skipped"):
        sq.setdefault(r["m"], r["median_s"])
ns = sorted(sq)
for a, b in zip(ns, ns[1:]):
    print("bakron %d^2 -> %d^2: time x%.2f, exponent %.2f" % (a, b, sq[b] / sq[a],
          math.log(sq[b] / sq[a]) / math.log(b / a)))
for n in ns:
    floor = n * n * (2.0 * n) / 51e12
    print("bakron %d^2: %.4f s, %.2f x the fp32 floor (%.4f s)" % (n, sq[n], sq[n] / floor, floor))
EOF
fi

note "gpu_run: $([ $status = 0 ] && echo ok || echo FAILED)"
exit $status
